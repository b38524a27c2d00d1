"""This machine's hardware figures: copy rates, matmul rate, device-memory rate and free memory.

Measured on the device the job will use (on a CPU-only machine the host stands in for the
device, so the planners run the same code in CI). :mod:`sysx.machine.hardware_cache` keeps them
per machine; :func:`sysx.single.hardware.assumed_hardware` builds a profile for a machine you are
not on. The pipeline's optimizer placement, the single-GPU planner and the autotuner all read them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from sysx import device as dev
from sysx.machine.host_cost import measure_op_host_s
from sysx.memory.pinned import HostBuffers

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """Rates in bytes/s or FLOP/s and capacities in bytes. ``measured`` False for assumed numbers."""

    name: str
    kind: str  # "cuda" or "cpu"
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    bidir_bytes_per_s: float  # per direction, while both directions copy at once
    matmul_flops_per_s: float
    device_mem_bytes_per_s: float
    device_free_bytes: int
    device_total_bytes: int
    host_free_bytes: int
    host_total_bytes: int
    measured: bool = True
    # host work the layer times leave out (:mod:`sysx.machine.host_cost`); 0 in assumed profiles
    op_host_s: float = 0.0  # seconds of one executor instruction's fixed Python cost
    process_bytes: int = 0  # resident bytes a training process adds besides its training state
    # copies from and to pageable host memory (the optimizer device lane's masters and moments);
    # 0: not measured, the page-locked rates stand in
    h2d_pageable_bytes_per_s: float = 0.0
    d2h_pageable_bytes_per_s: float = 0.0

    @property
    def pageable_copy_rates(self) -> tuple[float, float]:
        """Host->device and device->host bytes/s from and to pageable host memory: the measured
        figures, or the page-locked ones where they were not measured."""
        return (
            self.h2d_pageable_bytes_per_s or self.h2d_bytes_per_s,
            self.d2h_pageable_bytes_per_s or self.d2h_bytes_per_s,
        )

    @property
    def link_bytes_per_s(self) -> float:
        """The interconnect bandwidth ``BW_inter`` of the AdaWS formulas: the slower single direction."""
        return min(self.h2d_bytes_per_s, self.d2h_bytes_per_s)

    def describe(self) -> str:
        """One line with every figure, in GB/s, TFLOP/s and GiB."""
        how = "measured" if self.measured else "assumed"
        return (
            f"{self.name} ({how}): h2d {self.h2d_bytes_per_s / GB:.1f} GB/s, d2h {self.d2h_bytes_per_s / GB:.1f} GB/s, "
            f"both at once {self.bidir_bytes_per_s / GB:.1f} GB/s each way, matmul {self.matmul_flops_per_s / 1e12:.2f} TFLOP/s, "
            f"device memory {self.device_mem_bytes_per_s / GB:.0f} GB/s, device free {self.device_free_bytes / GiB:.1f} of "
            f"{self.device_total_bytes / GiB:.1f} GiB, host free {self.host_free_bytes / GiB:.1f} of {self.host_total_bytes / GiB:.1f} GiB, "
            f"{self.op_host_s * 1e6:.1f} us host per op, {self.process_bytes / 2**20:.0f} MiB per process"
            + (
                f", pageable h2d {self.h2d_pageable_bytes_per_s / GB:.1f} GB/s, d2h {self.d2h_pageable_bytes_per_s / GB:.1f} GB/s"
                if self.kind == "cuda" and self.h2d_pageable_bytes_per_s
                else ""
            )
        )

    def as_dict(self) -> dict[str, float | int | str | bool]:
        """Plain fields (for logs and JSON)."""
        return asdict(self)


# ------------------------------------------------------------------------------------- measuring


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _host_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _time_cpu(fn, repeats: int, fastest: bool = False) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if fastest else _median(times)


def _time_cuda(fn, device: torch.device, repeats: int, fastest: bool = False) -> float:
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return min(times) if fastest else _median(times)


def mean_run_seconds(step: Callable[[], object], *, repeats: int, window_s: float) -> tuple[float, float]:
    """``(wall, CPU)`` seconds per call of ``step`` over at least ``repeats`` calls and ``window_s``
    seconds: the window's totals over the calls, so the time slices the calls waited for count."""
    t0, c0 = time.perf_counter(), time.thread_time()
    runs = 0
    while runs < repeats or time.perf_counter() - t0 < window_s:
        step()
        runs += 1
    return (time.perf_counter() - t0) / runs, (time.thread_time() - c0) / runs


def mean_in_rounds(steps: Sequence[Callable[[], object]], *, rounds: int, window_s: float) -> list[float]:
    """Wall seconds per call of each of ``steps`` on the CPU: one warm-up call each, then ``rounds``
    rounds, each timing every step over one window of ``window_s`` (one call at least,
    :func:`mean_run_seconds`); each step's mean over its rounds.

    The mean, because a run pays a pass's typical time, time slices and all, not its fastest; the
    rounds, because they spread each step's windows over the whole measurement, so on a machine
    whose speed drifts every step averages the same stretch of it and the steps keep their
    proportions (issue 27: an AMD EPYC VM ran the same Block 1.35x apart between 2-s windows)."""
    for step in steps:
        step()
    sums = [0.0] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            sums[i] += mean_run_seconds(step, repeats=1, window_s=window_s)[0]
    return [s / rounds for s in sums]


def time_op(fn: Callable[[], object], device: torch.device, repeats: int, *, fastest: bool = False) -> float:
    """Seconds of ``fn`` after one warm-up: CUDA events on a GPU, the wall clock on CPU; the median
    of ``repeats``, or with ``fastest`` the minimum (a GPU's kernels barely vary between runs). What
    a run pays on a shared CPU is a pass's mean over many time slices: :func:`mean_run_seconds`."""
    if dev.is_cuda(device):
        return _time_cuda(fn, device, repeats, fastest)
    return _time_cpu(fn, repeats, fastest)


def measure_matmul(device: torch.device, dtype: torch.dtype, *, n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of ``n x n @ n x n`` matmuls in ``dtype`` on ``device`` (``2 n^3`` FLOPs each)."""
    cuda = dev.is_cuda(device)
    if n is None:
        n = 4096 if cuda else (256 if dtype == torch.float16 else 512)  # CPU fp16 matmul is ~1 GFLOP/s
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = time_op(lambda: a @ b, device, repeats)
    return 2.0 * n**3 / max(seconds, 1e-9)


def memory_now(device: torch.device) -> dict[str, int]:
    """The free and total memory fields of :class:`HardwareProfile`, read now (they change between runs)."""
    host_free, host_total = _host_memory()
    if dev.is_cuda(device):
        free, total = torch.cuda.mem_get_info(device)
    else:  # the host stands in for the device
        free, total = host_free, host_total
    return {
        "device_free_bytes": int(free),
        "device_total_bytes": int(total),
        "host_free_bytes": host_free,
        "host_total_bytes": host_total,
    }


def measure_hardware(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    nbytes: int | None = None,
    repeats: int = 3,
) -> HardwareProfile:
    """Measure the figures of :class:`HardwareProfile` on ``device`` (default: the default device).

    Takes well under a second on CPU (16 MiB copies, 512^3 matmuls) and about a second on a GPU
    (256 MiB copies, 4096^3 matmuls).
    """
    device = dev.default_device() if device is None else torch.device(device)
    host_free, host_total = _host_memory()
    if dev.is_cuda(device):
        return _measure_cuda(device, dtype, nbytes or 256 * 1024**2, repeats, host_free, host_total)
    return _measure_cpu(dtype, nbytes or 16 * 1024**2, repeats, host_free, host_total)


def _cuda_copy_rates(device: torch.device, buffers: HostBuffers, nbytes: int, repeats: int) -> tuple[float, ...]:
    """``(h2d, d2h, both directions at once, device memory)`` bytes/s; the tensors die on return,
    before the caller closes the pinned ``buffers``."""
    n = nbytes // 4
    host_a = buffers.empty(n, torch.float32).fill_(1.0)
    host_b = buffers.empty(n, torch.float32)
    dev_a = torch.empty(n, dtype=torch.float32, device=device)
    dev_b = torch.ones(n, dtype=torch.float32, device=device)
    h2d = nbytes / _time_cuda(lambda: dev_a.copy_(host_a, non_blocking=True), device, repeats)
    d2h = nbytes / _time_cuda(lambda: host_b.copy_(dev_b, non_blocking=True), device, repeats)
    s_in, s_out = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both() -> None:
        cur = torch.cuda.current_stream(device)
        s_in.wait_stream(cur)
        s_out.wait_stream(cur)
        with torch.cuda.stream(s_in):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s_out):
            host_b.copy_(dev_b, non_blocking=True)
        cur.wait_stream(s_in)
        cur.wait_stream(s_out)

    bidir = nbytes / _time_cuda(both, device, repeats)
    d2d = 2 * nbytes / _time_cuda(lambda: dev_a.copy_(dev_b), device, repeats)  # read + write
    return h2d, d2h, bidir, d2d


def _cuda_pageable_rates(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """Host->device and device->host bytes/s from and to plain (pageable) host tensors: CUDA stages
    them through its own page-locked buffer, at a rate the page-locked figures overstate."""
    host = torch.ones(nbytes // 4, dtype=torch.float32)
    on_device = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    h2d = nbytes / _time_cuda(lambda: on_device.copy_(host), device, repeats)
    d2h = nbytes / _time_cuda(lambda: host.copy_(on_device), device, repeats)
    return h2d, d2h


def _measure_cuda(
    device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int, host_free: int, host_total: int
) -> HardwareProfile:
    buffers = HostBuffers("copy-rate probe", pin=True)
    h2d, d2h, bidir, d2d = _cuda_copy_rates(device, buffers, nbytes, repeats)
    h2d_pageable, d2h_pageable = _cuda_pageable_rates(device, nbytes, repeats)
    flops = measure_matmul(device, dtype, repeats=repeats)
    free, total = torch.cuda.mem_get_info(device)
    buffers.close()
    return HardwareProfile(
        name=f"{device} ({torch.cuda.get_device_name(device)})",
        kind="cuda",
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        bidir_bytes_per_s=min(bidir, h2d, d2h),
        matmul_flops_per_s=flops,
        device_mem_bytes_per_s=d2d,
        device_free_bytes=int(free),
        device_total_bytes=int(total),
        host_free_bytes=host_free,
        host_total_bytes=host_total,
        op_host_s=measure_op_host_s(repeats),
        h2d_pageable_bytes_per_s=h2d_pageable,
        d2h_pageable_bytes_per_s=d2h_pageable,
    )


def _measure_cpu(dtype: torch.dtype, nbytes: int, repeats: int, host_free: int, host_total: int) -> HardwareProfile:
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty(n, dtype=torch.float32)
    src2 = torch.ones(n, dtype=torch.float32)
    dst2 = torch.empty(n, dtype=torch.float32)
    one_way = nbytes / _time_cpu(lambda: dst.copy_(src), repeats)

    def both() -> None:
        worker = threading.Thread(target=lambda: dst2.copy_(src2))
        worker.start()
        dst.copy_(src)
        worker.join()

    bidir = nbytes / _time_cpu(both, repeats)
    flops = measure_matmul(torch.device("cpu"), dtype, repeats=repeats)
    return HardwareProfile(
        name="cpu (host memory stands in for the device)",
        kind="cpu",
        h2d_bytes_per_s=one_way,
        d2h_bytes_per_s=one_way,
        bidir_bytes_per_s=min(bidir, one_way),
        matmul_flops_per_s=flops,
        device_mem_bytes_per_s=2 * one_way,
        device_free_bytes=host_free,
        device_total_bytes=host_total,
        host_free_bytes=host_free,
        host_total_bytes=host_total,
        op_host_s=measure_op_host_s(repeats),
    )
