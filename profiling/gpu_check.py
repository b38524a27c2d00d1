"""The Python half of ``profiling/gpu_check.sh`` (issue 17): what only a GPU can confirm.

``python profiling/gpu_check.py all`` prints one section per check; without CUDA each GPU part
prints a ``SKIP (no CUDA): ...`` line and the CPU half still runs. ``losses SCHEDULE DEVICE`` (run
in a child process, so ``TORCH_CUDA_SANITIZER=1`` is set before torch loads) prints the losses of
3 steps of a 1-process run as JSON.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import torch

GiB = 1 << 30
REPORT_LINES = 80  # of a sanitizer report: its kernel, the tensor's accesses and both stacks
SCHEDULES = ("sysx", "gpipe", "single")
ONE_B = [
    "model.max_seq_len=2048",
    "model.dim=2048",
    "model.n_layers=16",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.ffn_dim=5632",
    "model.vocab_size=32000",
]


def skip(what: str) -> None:
    """The line that says what the reduced (CPU) form left out."""
    print(f"SKIP (no CUDA): {what}", flush=True)


def _small(device: str) -> list[str]:
    return [
        "model=tiny",
        "train.seq_len=64",
        "train.micro_batch_size=2",
        "train.micro_batches=2",
        "train.steps=3",
        "optim.lr=1e-3",
        "optim.warmup_steps=2",
        "eval.every=0",
        f"device={device}",
        "precision=fp32",
    ]


def losses(schedule: str, device: str) -> list[float]:
    """3 steps of a 1-process ``schedule`` run on ``device``."""
    from sysx.config import load_config

    if schedule == "single":
        from sysx.trainers.single import SingleTrainer

        trainer = SingleTrainer(load_config(_small(device) + ["schedule=single", "optim.backend=torch"]))
    else:
        from sysx.runtime import PipelineOptions
        from sysx.trainers.pipeline import PipelineTrainer

        trainer = PipelineTrainer(
            load_config(_small(device)), PipelineOptions(optim_backend="torch", schedule=schedule)
        )
    try:
        return [r.loss for r in trainer.run(3)]
    finally:
        trainer.close()


def sanitizer_report(lines: list[str], limit: int = REPORT_LINES) -> list[str]:
    """The CUDA sanitizer's first report in a child's stderr: from its "CSAN detected" line on, with
    the two stacks it gives (the access now and the one before), at most ``limit`` lines; [] when
    there is none. The one-line summary alone named no tensor or op (second H200 lease)."""
    start = next((i for i, line in enumerate(lines) if "CSAN detected" in line), None)
    if start is None:
        return []
    return lines[start : start + limit]


def check_losses(cuda: bool) -> None:
    """Each schedule on CUDA under the CUDA sanitizer against the same run on CPU (1e-4 relative)."""
    for schedule in SCHEDULES:
        runs = {}
        for device in ("cpu", "cuda") if cuda else ("cpu",):
            env = {**os.environ, **({"TORCH_CUDA_SANITIZER": "1"} if device == "cuda" else {})}
            proc = subprocess.run(
                [sys.executable, __file__, "losses", schedule, device],
                capture_output=True,
                text=True,
                env=env,
                timeout=240,
            )
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines()
                print(f"FAIL losses {device} {schedule}: {lines[-1:]}", flush=True)
                for line in sanitizer_report(lines):
                    print(f"  | {line}", flush=True)
                continue
            runs[device] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"losses {device} {schedule}: {runs[device]}", flush=True)
        if not cuda:
            skip(f"{schedule} with device=cuda under TORCH_CUDA_SANITIZER=1 and its comparison with device=cpu")
        elif len(runs) == 2:
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs["cuda"], runs["cpu"]))
            print(
                f"{'OK' if worst <= 1e-4 else 'FAIL'} {schedule}: cuda vs cpu max relative difference {worst:.2e} "
                f"(limit 1e-4)",
                flush=True,
            )


def check_shm_copy(cuda: bool) -> None:
    """Host->device GB/s from a registered /dev/shm mapping, and how long the copy call itself takes."""
    if not cuda:
        skip("shared-memory host->device GB/s with the segment registered, and the copy call's return time")
        return
    from sysx.memory.pinned import register_host_memory

    nbytes = 1 * GiB
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="sysx-gpucheck-") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        host.fill_(1)
        reg = register_host_memory(host.data_ptr(), nbytes, label="gpu_check segment", pin=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        returned = time.perf_counter() - t0
        end.record()
        end.synchronize()
        copy_s = start.elapsed_time(end) / 1000
        print(
            f"shm h2d: registered={reg is not None}, {nbytes / copy_s / 1e9:.1f} GB/s, copy {copy_s * 1e3:.2f} ms, "
            f"call returned after {returned * 1e3:.3f} ms ({'OK' if returned < copy_s / 10 else 'FAIL: the call blocked'})",
            flush=True,
        )
        del dst
        if reg is not None:
            reg.unregister()
        del host
        mm.close()


def check_pinned(cuda: bool) -> None:
    """Pinned bytes held vs requested (exact-size registration; torch's caching host allocator for comparison)."""
    from sysx.memory.pinned import HostBuffers

    sizes = [5 * 10**6 + 17, 3 * 10**7 + 1, 123_457]
    buffers = HostBuffers("gpu_check pinned", pin=None)
    for n in sizes:
        buffers.empty(n, torch.uint8)
    print(f"pinned: requested {sum(sizes)} B, held {buffers.pinned_bytes} B (registered in place)", flush=True)
    buffers.close()
    if not cuda:
        skip("torch.empty(pin_memory=True) comparison (the caching host allocator's rounding)")
        return
    held = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    print(
        f"pinned via torch.empty(pin_memory=True): requested {sum(sizes)} B, allocator holds "
        f"{stats.get('allocated_bytes.current', stats.get('reserved_bytes.current', 'n/a'))} B",
        flush=True,
    )
    del held


def check_single_budget(cuda: bool, budget_gb: float = 12.0) -> None:
    """``schedule=single`` on a ~1B shape: reserved, NVML and mem_get_info against the budget."""
    if not cuda:
        skip(f"schedule=single on a ~1B shape under {budget_gb:g} GiB: max_memory_reserved, mem_get_info, NVML")
        return
    from sysx.config import load_config
    from sysx.device_memory import device_usage, over_budget
    from sysx.trainers.single import SingleTrainer

    cfg = load_config(
        [
            "model=tiny",
            *ONE_B,
            "train.seq_len=2048",
            "train.micro_batch_size=4",
            "train.micro_batches=2",
            "train.steps=2",
            "eval.every=0",
            "device=cuda",
            "precision=bf16",
            "schedule=single",
            f"single.device_memory_gb={budget_gb}",
        ]
    )
    trainer = SingleTrainer(cfg)
    try:
        t0 = time.perf_counter()
        results = trainer.run(2)
        usage = device_usage(trainer.device)
        assert usage is not None
        print(
            f"single ~1B: losses {[round(r.loss, 4) for r in results]}, {time.perf_counter() - t0:.1f} s, "
            f"W={trainer.plan.window}/{trainer.plan.sizes.n_blocks}; {usage.describe()}",
            flush=True,
        )
        over = over_budget(usage, int(budget_gb * GiB))
        print(
            f"{'OK' if not over else 'FAIL'} budget {budget_gb:g} GiB: {'; '.join(over) or 'reserved and NVML within'}",
            flush=True,
        )
    finally:
        trainer.close()


def check_keep_graph(cuda: bool) -> None:
    """``single.keep_graph``: the same losses as saving every site, the step time of each, the peak against the plan."""
    from sysx.config import load_config
    from sysx.device_memory import device_usage
    from sysx.trainers.single import SingleTrainer

    device = "cuda" if cuda else "cpu"
    shape = ["model=tiny", *ONE_B, "train.seq_len=1024", "precision=bf16"] if cuda else _small("cpu")
    if not cuda:
        skip("single.keep_graph on a ~1B shape on CUDA (a tiny CPU run instead)")
    rows = {}
    for keep in (True, False, True, False):  # interleaved: the second pair is timed after the first warmed up
        cfg = load_config(
            [
                *shape,
                "train.micro_batch_size=2",
                "train.micro_batches=2",
                "train.steps=4",
                "eval.every=0",
                f"device={device}",
                "schedule=single",
                "single.policy=everything",
                f"single.keep_graph={str(keep).lower()}",
                "single.print_plan=false",
                "optim.backend=torch",
            ]
        )
        trainer = SingleTrainer(cfg)
        try:
            results = trainer.run(1)
            t0 = time.perf_counter()
            results += trainer.run(3)
            step_s = (time.perf_counter() - t0) / 3
            usage = device_usage(trainer.device)
            rows[keep] = (
                [round(r.loss, 5) for r in results],
                step_s,
                trainer.plan.keep_graph,
                trainer.plan.device_bytes["total"],
                usage.describe() if usage is not None else "no device counters",
            )
        finally:
            trainer.close()
    for keep, (losses_, step_s, planned_keep, planned, usage_) in rows.items():
        print(
            f"keep_graph={keep} (plan {planned_keep}): losses {losses_}, {step_s * 1e3:.1f} ms/step; plan {planned / GiB:.3f} GiB; {usage_}",
            flush=True,
        )
    same = rows[True][0] == rows[False][0]
    print(
        f"{'OK' if same else 'FAIL'} keep_graph: losses {'equal' if same else 'differ'}; step time kept/replayed "
        f"{rows[True][1] / rows[False][1]:.3f}",
        flush=True,
    )


def main(argv: list[str]) -> int:
    """``all`` (default) or ``losses SCHEDULE DEVICE``."""
    if argv[:1] == ["losses"]:
        print(json.dumps(losses(argv[1], argv[2])), flush=True)
        return 0
    cuda = torch.cuda.is_available()
    print(
        f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu (reduced form)'}",
        flush=True,
    )
    for check in (check_losses, check_shm_copy, check_pinned, check_single_budget, check_keep_graph):
        print(f"== {check.__doc__.splitlines()[0]}", flush=True)
        check(cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
