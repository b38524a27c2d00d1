"""A machine + model profile, measured in a few seconds (ProTrain's profiler, paper section 3.3).

:func:`measure_profile` times the real layers of the job's model shape (one Embedding, one Block,
the Head) on the job's device for each micro-batch size: the forward without autograd (how the
pipeline runs forwards) and the backward with its recompute (forward with autograd + backward).
It adds the hardware figures of :mod:`sysx.machine.hardware` (the same profile the single-device
planner uses), the CPU Adam throughput of one thread (:func:`sysx.machine.adam_rate.adam_params_per_s`)
and that of a whole optimizer job (:func:`~sysx.machine.adam_rate.optimizer_job_params_per_s`), and
the free host memory and ``/dev/shm`` (:func:`sysx.memory.budget.probe_host`).

Layer times are stored per token count (micro-batch size x sequence length) and interpolated
linearly in between (proportionally beyond the measured range), so one profile also answers for
other micro-batch sizes and, for the memory questions of the search, shorter sequences.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sysx import device as dev
from sysx.autotune.p2p import P2PFigures
from sysx.machine.adam_rate import adam_params_per_s, optimizer_job_params_per_s
from sysx.machine.hardware import HardwareProfile, mean_in_rounds, measure_hardware, time_op
from sysx.machine.hardware_cache import machine_key
from sysx.machine.host_cost import PROBE_BLOCKS, measure_backward_bytes
from sysx.memory.budget import probe_host
from sysx.model import ModelConfig
from sysx.model.flops import block_params
from sysx.model.llama import init_layer, make_layer
from sysx.optim.cores import usable_physical_cores
from sysx.schedule.costs import model_layer_act_bytes

LAYER_KINDS = ("embedding", "block", "head")


@dataclass(frozen=True)
class LayerTiming:
    """Seconds of one layer on ``tokens`` tokens: forward (no autograd) and backward with recompute."""

    tokens: int
    fwd_s: float
    bwd_s: float


@dataclass
class MachineProfile:
    """What :func:`measure_profile` found; JSON round trip with :meth:`to_json` / :meth:`from_json`.

    ``layers[kind]``: timings sorted by tokens. ``adam_params_per_s``: parameters one CPU Adam
    thread steps per second. ``cpu_threads``: physical cores the job may use on this node (what
    :mod:`sysx.optim.cores` splits between ranks). ``p2p``: the links between the job's ranks. ``host_available`` / ``shm_free`` / ``shm_total``: bytes.
    """

    machine: dict[str, str]
    shape: dict[str, Any]
    hardware: HardwareProfile
    layers: dict[str, list[LayerTiming]]
    adam_params_per_s: float
    cpu_threads: int
    host_available: int
    shm_free: int
    shm_total: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    p2p: P2PFigures | None = None  # measured between the job's ranks at tune time (:mod:`sysx.autotune.p2p`)
    # the job's layers over the profile's, its ranks measured together at tune time (:mod:`sysx.autotune.contention`)
    slowdown: float | None = None
    # CPU seconds of the job's layers per profile second, from the same measurement (the node's host lane)
    cpu_ratio: float | None = None
    # seconds a step's end costs beyond its ranks' compute, measured with them (the same measurement)
    meeting_s: float | None = None
    # parameters one worker thread's whole optimizer job handles per second (load and check the
    # gradients, step, write the working copy), what a plan charges a job; None: the Adam rate's
    optim_job_params_per_s: float | None = None
    # on a CPU "device": [tokens, bytes per Block, bytes once] a sub-stage's backward holds at its
    # peak (:func:`sysx.machine.host_cost.measure_backward_bytes`), by tokens; None: not measured
    backward_bytes: list[list[int]] | None = None

    def backward_work(self, tokens: float) -> tuple[float, float] | None:
        """``(per Block, once)`` bytes a sub-stage's backward holds on ``tokens`` tokens: interpolated
        between the measured points around ``tokens``; outside them, the nearest point scaled in
        proportion (activations grow with the tokens); None when not measured."""
        if not self.backward_bytes:
            return None
        return _by_tokens([(t, (float(a), float(b))) for t, a, b in self.backward_bytes], tokens)

    def layer_time(self, kind: str, tokens: float) -> tuple[float, float]:
        """``(forward, backward-with-recompute)`` seconds of a ``kind`` layer on ``tokens`` tokens."""
        points = self.layers[kind]
        if not points:
            raise ValueError(f"the profile has no timing of the {kind} layer")
        return _by_tokens([(p.tokens, (p.fwd_s, p.bwd_s)) for p in points], tokens)

    def measured_tokens(self) -> set[int]:
        """Token counts every layer kind was timed at."""
        return set.intersection(*({p.tokens for p in self.layers[k]} for k in LAYER_KINDS))

    def to_json(self) -> str:
        """The profile as one JSON document."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["hardware"] = HardwareProfile(**data["hardware"])
        data["layers"] = {k: [LayerTiming(**p) for p in v] for k, v in data["layers"].items()}
        if data.get("p2p") is not None:
            data["p2p"] = P2PFigures(**data["p2p"])
        return cls(**data)


def _by_tokens(points: list[tuple[int, tuple[float, float]]], tokens: float) -> tuple[float, float]:
    """A pair measured at ``(tokens, pair)`` points, at ``tokens``: interpolated between the points
    around it; outside them, the nearest point's pair in proportion to the tokens."""
    lo = max((p for p in points if p[0] <= tokens), key=lambda p: p[0], default=None)
    hi = min((p for p in points if p[0] >= tokens), key=lambda p: p[0], default=None)
    if lo is None or hi is None:
        near = hi if lo is None else lo
        assert near is not None, "no points"
        scale = tokens / near[0]
        return near[1][0] * scale, near[1][1] * scale
    if hi[0] == lo[0]:
        return lo[1]
    w = (tokens - lo[0]) / (hi[0] - lo[0])
    return lo[1][0] + w * (hi[1][0] - lo[1][0]), lo[1][1] + w * (hi[1][1] - lo[1][1])


# A CPU profile times each pass by :func:`~sysx.machine.hardware.mean_in_rounds`, not as its fastest
# of 3 (until PROFILE_VERSION 8): on the AMD EPYC VM of 2026-12-02 a tiny Block at 8 sequences ran
# 29-46 ms from one call to the next, the fastest of 3 read 0.70-1.41x a window's mean, a different
# way at each micro-batch size, and tuned plans of one layout scattered over 0.18-0.40 s against
# runs of 0.26-0.35 s (issue 27). A GPU times kernels with its events: the fastest of ``repeats``,
# as they barely vary.
WINDOW_S = 0.1  # a CPU pass's window in one round: many of the kernel's time slices (a few ms each)


@dataclass(frozen=True)
class _LayerPasses:
    """One layer kind at one micro-batch size: its forward without autograd and the backward a
    pipeline runs (recompute from the checkpoint with autograd, then backprop)."""

    kind: str
    tokens: int
    forward: Callable[[], object]
    backward: Callable[[], None]


def _layer_passes(
    layer: torch.nn.Module,
    kind: str,
    cfg: ModelConfig,
    mbs: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> _LayerPasses:
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (mbs, seq_len), generator=gen).to(device)
    hidden = torch.randn(mbs, seq_len, cfg.dim, generator=gen).to(device=device, dtype=dtype)
    x = ids if kind == "embedding" else hidden

    def forward() -> object:
        with torch.no_grad():
            return layer(x, ids) if kind == "head" else layer(x)  # the head returns the loss

    def backward() -> None:
        inp = x if kind == "embedding" else x.detach().requires_grad_(True)
        out = layer(inp, ids) if kind == "head" else layer(inp)
        out.backward(None if kind == "head" else torch.ones_like(out))

    return _LayerPasses(kind, mbs * seq_len, forward, backward)


def _time_layers(
    cfg: ModelConfig, micro_batch_sizes: list[int], seq_len: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> dict[str, list[LayerTiming]]:
    """Every layer kind's passes at every micro-batch size. On a GPU one layer at a time, each pass
    the fastest of ``repeats`` (events). On the CPU every kind and size at once, each pass the mean
    of ``repeats`` rounds of one :data:`WINDOW_S` window (:func:`~sysx.machine.hardware.mean_in_rounds`)."""
    sizes = sorted(set(micro_batch_sizes))
    layers: dict[str, list[LayerTiming]] = {k: [] for k in LAYER_KINDS}
    if dev.is_cuda(device):
        for kind in LAYER_KINDS:
            layer = _profiled_layer(cfg, kind, device, dtype)
            for mbs in sizes:
                p = _layer_passes(layer, kind, cfg, mbs, seq_len, device, dtype)
                fwd = time_op(p.forward, device, repeats, fastest=True)
                layers[kind].append(LayerTiming(p.tokens, fwd, time_op(p.backward, device, repeats, fastest=True)))
            del layer
        return layers
    built = {kind: _profiled_layer(cfg, kind, device, dtype) for kind in LAYER_KINDS}
    passes = [
        _layer_passes(built[kind], kind, cfg, mbs, seq_len, device, dtype) for kind in LAYER_KINDS for mbs in sizes
    ]
    times = mean_in_rounds([f for p in passes for f in (p.forward, p.backward)], rounds=repeats, window_s=WINDOW_S)
    for i, p in enumerate(passes):
        layers[p.kind].append(LayerTiming(p.tokens, times[2 * i], times[2 * i + 1]))
    return layers


def _profiled_layer(cfg: ModelConfig, kind: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    index = {"embedding": 0, "block": 1, "head": cfg.n_layers + 1}[kind]
    layer = make_layer(cfg, index, dtype=dtype, device=device)
    init_layer(layer, index)  # uninitialised memory can hold denormals and NaNs, which time differently
    return layer


BACKWARD_MAX_TOKENS = 4096  # the backward's bytes a token have settled by then (dim 512: 62 KiB at 1024, 58 at 2048)


def backward_probe_tokens(token_counts: list[int]) -> list[int]:
    """The token counts the backward's bytes are measured at: every one up to
    :data:`BACKWARD_MAX_TOKENS` (the fewest alone when all are past it); past the cap the bytes are
    scaled in proportion (:meth:`MachineProfile.backward_work`), as they then are.

    Every count, not the two ends interpolated: what glibc keeps of the freed workspace does not
    grow in proportion to the tokens. Four tiny Blocks at 512 tokens peak at 30-31 MiB where the
    line from 128 to 2048 tokens read 27 (issue 27). The cap keeps a large model's probe affordable
    (its two fresh processes backpropagate a sub-stage at every count, the largest dominating); a
    single process takes the counts in ascending order, so what the heap keeps of one count serves
    the next, as a rank's repeated steps reuse theirs."""
    counts = sorted(set(token_counts))
    kept = [c for c in counts if c <= BACKWARD_MAX_TOKENS]
    return kept or counts[:1]


PROBE_SHARE = 0.25  # of the host memory available: what the backward probe's two processes may hold


def probe_blocks(cfg: ModelConfig, tokens: int, dtype_bytes: int, available: float) -> int:
    """The larger sub-stage the backward probe runs: :data:`PROBE_BLOCKS`, or fewer (2 at least)
    where its two processes (one Block and that many, at once) would pass :data:`PROBE_SHARE` of the
    ``available`` host bytes by the shape estimate: a Block's parameters and gradients, and twice
    its activations at ``tokens`` (the probe reads up to 1.8x the estimate: the recompute's
    temporaries and what glibc keeps). A large model's probe on a small machine then holds no more
    than the old probe of two Blocks did."""
    per_block = 2 * dtype_bytes * block_params(cfg) + 2 * model_layer_act_bytes(cfg, tokens, dtype_bytes)[1]
    for k in range(PROBE_BLOCKS, 2, -1):
        if (1 + k) * per_block <= PROBE_SHARE * available:
            return k
    return 2


def measure_profile(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch_sizes: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    repeats: int = 3,
    adam_backend: str = "auto",
    hardware: HardwareProfile | None = None,
) -> MachineProfile:
    """Measure a :class:`MachineProfile` for ``cfg`` at ``seq_len`` and each micro-batch size
    (``hardware``: this machine's figures when already known, else measured too)."""
    t0 = time.perf_counter()
    device = dev.default_device() if device is None else torch.device(device)
    hardware = measure_hardware(device, dtype, repeats=repeats) if hardware is None else hardware
    layers = _time_layers(cfg, micro_batch_sizes, seq_len, device, dtype, repeats)
    cap = probe_host()
    host = cap.ram_available if cap.cgroup is None else min(cap.ram_available, cap.cgroup.available)
    backward = None
    if not dev.is_cuda(device):  # the "device" memory is host memory, counted as the check counts it
        tokens = backward_probe_tokens([mbs * seq_len for mbs in micro_batch_sizes])
        blocks = probe_blocks(cfg, tokens[-1], dtype.itemsize, host)
        found = measure_backward_bytes(cfg, seq_len, tokens, dtype, blocks=blocks)
        backward = [[t, a, b] for t, (a, b) in sorted(found.items())] or None
    return MachineProfile(
        machine=machine_key(device),
        shape=shape_key(cfg, seq_len, dtype),
        hardware=hardware,
        layers=layers,
        adam_params_per_s=adam_params_per_s(threads=1, backend=adam_backend, repeat=repeats),
        optim_job_params_per_s=optimizer_job_params_per_s(dtype=dtype, backend=adam_backend, repeat=repeats),
        cpu_threads=usable_physical_cores()[0],
        host_available=int(host),
        shm_free=cap.shm_free,
        shm_total=cap.shm_total,
        seconds=time.perf_counter() - t0,
        backward_bytes=backward,
    )


def shape_key(cfg: ModelConfig, seq_len: int, dtype: torch.dtype) -> dict[str, Any]:
    """The model shape a profile was measured for: every ModelConfig field, the sequence length, the dtype."""
    return {**asdict(cfg), "seq_len": int(seq_len), "dtype": str(dtype).removeprefix("torch.")}
