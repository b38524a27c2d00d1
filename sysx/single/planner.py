"""Automatic configuration of the sliding-window executor (AdaWS §3.2, appendix B) under hard budgets.

Given the model, the sequence length, the global batch (fixed: only its split changes), the
precision, the hardware figures and the device/host budgets, :func:`make_plan` decides:

1. **Sequences per round** ``X`` (§3.2.2): a block's forward must outlast moving its weights in
   and its gradients out, ``T_fwd >= (1 + |tau_grad| / |tau_param|) * T_param``, which gives
   ``X >= (|tau_p| + |tau_g|) * psi_total * P / (2 * S * (psi_active + S * d_attn) * BW)``. ``X`` is
   the smallest divisor of the global batch ``G`` at least that large (rounds per step ``G / X``),
   capped so the window keeps ``W >= 2`` and the host can hold the layer inputs (footnote 4).
2. **Chunk size** ``b`` (sequences computed at once): the largest divisor of ``X`` whose transient
   workspace stays under a quarter of the budget left after the static buffers.
3. **Window** ``W = (C_dev - B) / L_bytes`` (§3.2.3) blocks, where ``L_bytes`` is a block's weights,
   gradients and activation slots for the round and ``B`` the static bytes (embedding and head
   weights and gradients, the transition table, the workspace). Ring sizes: ``R_param = R_grad = W``,
   ``R_act = W * chunks``.
4. **Saved activations** (§3.2.4): :func:`sysx.single.act_policy.solve_save_levels` on the first
   ``L - W`` blocks (the last ``W`` keep theirs on the device), or PyAO's rule, or a fixed level.
5. **Optimizer overlap**: each block's CPU Adam runs as soon as its gradients are home when no
   check can veto the step (no clipping, not fp16). Otherwise ``auto`` speculates while the previous
   step passed the checks (a vetoed speculative step is undone with ``CpuAdam.undo``, which costs
   no memory, and redone) and else steps after the norm, in forward order, overlapped with the next
   step's forward; ``backward`` / ``forward`` force one behaviour.

A plan that cannot fit raises :class:`PlanError` before anything is allocated, with the bytes needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from sysx.memory.budget import training_state_bytes
from sysx.model.config import ModelConfig
from sysx.model.flops import block_matmul_params
from sysx.single.act_policy import (
    LEVEL_NAMES,
    N_LEVELS,
    SaveProblem,
    parse_level,
    pyao_recompute_mask,
    simulate_forward,
    solve_save_levels,
)
from sysx.single.hardware import GiB, HardwareProfile
from sysx.single.rings import align
from sysx.single.sites import LayerProfile, Profiler, SlotLayout, profile_layer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CUDA_RESERVE = 256 * 1024**2  # cuBLAS / attention workspaces and allocator rounding on a GPU
WORKSPACE_SHARE = 0.25  # a chunk's transient workspace may use this share of the budget left


class PlanError(ValueError):
    """The job cannot run within the budgets; the message gives the bytes needed and the fix."""


def gib(n: float) -> str:
    """``n`` bytes as ``'1.23 GiB'`` (``'12.3 MiB'`` below a tenth of a GiB)."""
    if abs(n) < 0.1 * GiB:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.2f} GiB"


def gib_up(n: float) -> str:
    """``n`` bytes in GiB rounded *up* to 2 significant digits (a budget that is certainly enough)."""
    x = n / GiB
    if x <= 0:
        return "0"
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return f"{math.ceil(x / step) * step:.10g}"


# --------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for. ``0`` means automatic for ``chunk``, ``round_sequences`` and ``window``."""

    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step (never changed)
    precision: str = "fp32"
    device_budget_bytes: int | None = None  # None: the hardware's free device memory
    host_budget_bytes: int | None = None  # None: the hardware's free host memory
    chunk: int = 0
    round_sequences: int = 0
    window: int = 0
    policy: str = "dp"
    compress: bool = False
    grad_clip: float = 0.0
    optimizer_overlap: str = "auto"
    use_measured_times: bool = False  # value sites by their measured time (profile) instead of the model

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of weights, activations and gradients on the device."""
        return DTYPES[self.precision]

    @property
    def param_bytes(self) -> int:
        """``|tau_param|``."""
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts the plan needs."""

    n_blocks: int
    block_params: int  # psi_total of one block
    block_active: int  # psi_active: weights that take part in matmuls
    static_params: int  # embedding + head (a tied weight once)
    total_params: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelSizes:
        block = block_matmul_params(cfg) + 2 * cfg.dim
        static = cfg.vocab_size * cfg.dim + cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
        return cls(cfg.n_layers, block, block_matmul_params(cfg), static, static + cfg.n_layers * block)


def meta_profiler(cfg: ModelConfig, seq_len: int, dtype: torch.dtype) -> Profiler:
    """Profile one Block at chunk size ``b`` on the ``meta`` device (exact bytes, no memory, no time)."""
    from sysx.model.llama import make_layer

    cache: dict[int, LayerProfile] = {}

    def run(b: int) -> LayerProfile:
        if b not in cache:
            block = make_layer(cfg, 1, dtype=dtype, device="meta")
            x = torch.empty((b, seq_len, cfg.dim), dtype=dtype, device="meta")
            cache[b] = profile_layer(block, x, model_dim=cfg.dim)
        return cache[b]

    return run


# -------------------------------------------------------------------------------- per-level costs


@dataclass(frozen=True)
class LevelTable:
    """Per-chunk costs of one block at every save option (levels 0..4, plus ``pyao`` when asked)."""

    chunk: int
    slot_bytes: tuple[int, ...]  # bytes a chunk's slot holds at each option
    saved_s: tuple[float, ...]  # recompute time avoided per chunk at each option
    forward_s: float  # forward time of one chunk through one block
    site_s: tuple[float, ...]  # time of each site (profile order)
    names: tuple[str, ...]
    layouts: tuple[SlotLayout, ...]
    workspace_bytes: int  # transient memory of a chunk's backward (recompute + autograd)
    profile: LayerProfile  # the block profile the layouts index into


def site_seconds(profile: LayerProfile, hw: HardwareProfile, *, measured: bool) -> list[float]:
    """Time of every site: measured, or FLOPs / P for matmul and attention and 3 x bytes / memory rate otherwise."""
    out = []
    for s in profile.sites:
        if measured and s.seconds is not None:
            out.append(float(s.seconds))
        elif s.flops > 0:
            out.append(s.flops / hw.matmul_flops_per_s)
        else:
            out.append(3.0 * s.nbytes / hw.device_mem_bytes_per_s)
    return out


def pyao_sites(profile: LayerProfile, times: Sequence[float], hw: HardwareProfile) -> tuple[frozenset[int], list[float], list[bool]]:
    """PyAO's choice for a block: every site saved except IQR-outlier throughput sites faster than the link."""
    throughput = [s.nbytes / max(t, 1e-15) for s, t in zip(profile.sites, times)]
    mask = pyao_recompute_mask(throughput, hw.d2h_bytes_per_s)
    keep = frozenset(s.index for s, out in zip(profile.sites, mask) if not out)
    return keep, throughput, mask


def level_table(profile: LayerProfile, req: PlanRequest, hw: HardwareProfile, chunk: int, cfg: ModelConfig) -> LevelTable:
    """Slot bytes, recompute avoided and workspace of each option for chunks of ``chunk`` sequences."""
    times = site_seconds(profile, hw, measured=req.use_measured_times)
    by_index = {s.index: t for s, t in zip(profile.sites, times)}
    site_sets = [profile.level_sites(level) for level in range(N_LEVELS)]
    names = list(LEVEL_NAMES)
    if req.policy == "pyao":
        keep, _, _ = pyao_sites(profile, times, hw)
        site_sets.append(keep)
        names.append("pyao")
    layouts = [SlotLayout.build(profile, sites, compress=req.compress) for sites in site_sets]
    saved = [sum(by_index[i] for i in sites) for sites in site_sets]
    everything = SlotLayout.build(profile, site_sets[N_LEVELS - 1], compress=False)
    biggest = max((s.nbytes for s in profile.sites), default=0)
    ws_block = everything.nbytes + 3 * biggest
    tau = req.param_bytes
    tokens = chunk * req.seq_len
    ws_head = tokens * cfg.vocab_size * (2 * tau + 8) + 4 * tokens * cfg.dim * 4
    return LevelTable(
        chunk, tuple(layout.nbytes for layout in layouts), tuple(saved), float(sum(times)), tuple(times),
        tuple(names), tuple(layouts), int(max(ws_block, ws_head)), profile,
    )


# ------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class SinglePlan:
    """The chosen configuration, its memory accounting, predicted timing and the reasons."""

    request: PlanRequest
    hardware: HardwareProfile
    sizes: ModelSizes
    chunk: int  # b: sequences per chunk (the micro-batch the model computes at once)
    chunks: int  # chunks per round
    rounds: int  # rounds per step
    window: int  # W
    r_param: int
    r_grad: int
    r_act: int
    slot_level: int  # option the activation slots are sized for (window blocks use it)
    levels: tuple[int, ...]  # option of every block (the last W: slot_level)
    table: LevelTable
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    device_budget: int
    host_budget: int
    overlap: str  # "backward" (step as grads arrive), "forward" (after the norm) or "auto" (adaptive)
    feasible_no_stall: bool
    stall_s: float
    times: dict[str, float]
    policy_rows: tuple[dict[str, object], ...]
    reasons: tuple[str, ...] = ()

    @property
    def round_sequences(self) -> int:
        """``X``: sequences per round."""
        return self.chunk * self.chunks

    @property
    def micro_batches(self) -> int:
        """Chunks per step (each is one ``get_batch`` micro-batch of ``chunk`` sequences)."""
        return self.chunks * self.rounds

    @property
    def transfer_layers(self) -> int:
        """Blocks whose activations go to host memory: the first ``L - W``."""
        return self.sizes.n_blocks - self.window

    def render(self) -> str:
        """The printed plan: decisions with their reasons, memory and the policy comparison."""
        r = self.request
        lines = [
            f"sysx single-GPU plan (AdaWS sliding window) on {self.hardware.name}",
            f"  model: {self.sizes.n_blocks} blocks x {self.sizes.block_params / 1e6:.1f}M params + embedding/head "
            f"{self.sizes.static_params / 1e6:.1f}M = {self.sizes.total_params / 1e9:.3f}B, {r.precision}; seq_len {r.seq_len}; "
            f"global batch {r.global_batch} sequences = {r.global_batch * r.seq_len} tokens/step (kept)",
            f"  budgets: device {gib(self.device_budget)}, host {gib(self.host_budget)}",
            f"  -> {self.rounds} rounds x {self.chunks} chunks x {self.chunk} sequences; window W={self.window} of "
            f"{self.sizes.n_blocks} blocks; rings R_param={self.r_param}, R_grad={self.r_grad}, R_act={self.r_act}; "
            f"optimizer overlap: {self.overlap}",
        ]
        lines += [f"  * {reason}" for reason in self.reasons]
        lines.append("  device memory: " + ", ".join(f"{k} {gib(v)}" for k, v in self.device_bytes.items() if k != "total")
                     + f" = {gib(self.device_bytes['total'])} of {gib(self.device_budget)}")
        lines.append("  host memory: " + ", ".join(f"{k} {gib(v)}" for k, v in self.host_bytes.items() if k != "total")
                     + f" = {gib(self.host_bytes['total'])} of {gib(self.host_budget)}")
        lines.append("  saved-activation options (per step, same window; the choice is marked *):")
        lines.append("    policy        offload/step  recompute/step   stall/step  predicted step")
        for row in self.policy_rows:
            mark = "*" if row["chosen"] else " "
            lines.append(
                f"   {mark}{row['policy']:<13} {gib(row['offload_bytes']):>12}  {row['recompute_s'] * 1e3:>11.1f} ms"
                f"  {row['stall_s'] * 1e3:>10.1f} ms  {row['step_s'] * 1e3:>11.1f} ms"
            )
        t = self.times
        lines.append(
            f"  predicted: {t['step_s'] * 1e3:.1f} ms/step, {t['tokens_per_s']:.0f} tokens/s "
            f"(block forward per round {t['block_fwd_round_s'] * 1e3:.2f} ms, weights in {t['t_param_s'] * 1e3:.2f} ms, "
            f"grads out {t['t_grad_s'] * 1e3:.2f} ms)"
        )
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def min_round_sequences(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile) -> float:
    """AdaWS §3.2.2: the smallest ``X`` whose block forward hides the weight and gradient transfers."""
    cfg = req.model
    d_attn = cfg.n_heads * cfg.head_dim
    tau = req.param_bytes
    bw = hw.link_bytes_per_s
    return (tau + tau) * sizes.block_params * hw.matmul_flops_per_s / (
        2.0 * req.seq_len * (sizes.block_active + req.seq_len * d_attn) * bw)


@dataclass
class _Fit:
    round_seqs: int
    chunk: int
    window: int
    table: LevelTable
    static: dict[str, int]
    per_block: int
    slot_level: int


def _static_device(req: PlanRequest, sizes: ModelSizes, table: LevelTable, round_seqs: int, cuda: bool) -> dict[str, int]:
    tau = req.param_bytes
    cfg = req.model
    return {
        "embedding+head weights": align(sizes.static_params * tau),
        "embedding+head grads": align(sizes.static_params * tau),
        "transitions": align(round_seqs * req.seq_len * cfg.dim * tau),
        "workspace (est.)": int(table.workspace_bytes * 1.1) + (CUDA_RESERVE if cuda else 0),
    }


def _fit(req: PlanRequest, sizes: ModelSizes, table: LevelTable, round_seqs: int, budget: int, slot_level: int,
         cuda: bool) -> _Fit:
    tau = req.param_bytes
    chunks = round_seqs // table.chunk
    static = _static_device(req, sizes, table, round_seqs, cuda)
    per_block = align(sizes.block_params * tau) * 2 + chunks * align(table.slot_bytes[slot_level])
    free = budget - sum(static.values())
    window = min(sizes.n_blocks, max(0, free // per_block)) if free > 0 else 0
    return _Fit(round_seqs, table.chunk, int(window), table, static, per_block, slot_level)


def _host_fixed(req: PlanRequest, sizes: ModelSizes) -> dict[str, int]:
    n = sizes.total_params
    out = {name: per * n for name, per in training_state_bytes(req.dtype, grad_dtype=req.dtype).rows().items()}
    if req.precision != "fp32":
        out["fp32 grad scratch"] = 4 * max(sizes.block_params, sizes.static_params) * 2
    return out


def _overlap(req: PlanRequest) -> tuple[str, str]:
    """The optimizer overlap mode and why (CpuAdam's arithmetic undo makes speculation free of memory)."""
    can_veto = req.grad_clip > 0 or req.precision == "fp16"
    veto = (f"grad_clip={req.grad_clip:g}" if req.grad_clip > 0 else "") + (
        " and " if req.grad_clip > 0 and req.precision == "fp16" else "") + ("fp16 overflow" if req.precision == "fp16" else "")
    if req.optimizer_overlap == "forward":
        return "forward", ("optimizer: blocks step after the global norm is known, in forward order, overlapped with the "
                           "next step's forward (single.optimizer_overlap=forward)")
    if not can_veto:
        return "backward", ("optimizer: each block's CPU Adam steps as soon as its gradients are home, during the "
                            "backward pass (nothing can veto a step)")
    if req.optimizer_overlap == "backward":
        return "backward", (f"optimizer: each block steps as soon as its gradients are home (single.optimizer_overlap="
                            f"backward); when {veto} vetoes the step it is undone (CpuAdam.undo, no extra memory) and redone")
    return "auto", (f"optimizer: blocks step as soon as their gradients are home while the previous step passed the "
                    f"{veto} check (undone and redone if this one does not); after a step that needed it, the next steps "
                    f"after the global norm, overlapped with the following forward")


def make_plan(req: PlanRequest, hw: HardwareProfile, *, profiler: Profiler | None = None) -> SinglePlan:
    """Decide the configuration (see the module docstring) or raise :class:`PlanError` with the numbers."""
    cfg = req.model
    sizes = ModelSizes.of(cfg)
    L = sizes.n_blocks
    G = req.global_batch
    cuda = hw.kind == "cuda"
    profiler = profiler or meta_profiler(cfg, req.seq_len, req.dtype)
    device_budget = int(req.device_budget_bytes if req.device_budget_bytes else hw.device_free_bytes)
    host_budget = int(req.host_budget_bytes if req.host_budget_bytes else hw.host_free_bytes)
    reasons: list[str] = []
    if req.seq_len < 1 or G < 1:
        raise PlanError(f"seq_len={req.seq_len} and global batch={G} must be >= 1")

    # -- 1. sequences per round
    x_min = min_round_sequences(req, sizes, hw)
    if req.round_sequences:
        if G % req.round_sequences:
            raise PlanError(f"single.round_sequences={req.round_sequences} must divide the global batch {G} "
                            f"(train.micro_batch_size x train.micro_batches); divisors: {_divisors(G)}")
        candidates = [req.round_sequences]
        reasons.append(f"round: {req.round_sequences} sequences per round (single.round_sequences); AdaWS 3.2.2 would "
                       f"want >= {x_min:.2f}")
    else:
        divs = [d for d in _divisors(G) if not req.chunk or d % req.chunk == 0]
        if not divs:
            raise PlanError(f"single.micro_batch_size={req.chunk} must divide the global batch {G}; divisors: {_divisors(G)}")
        above = [d for d in divs if d >= x_min]
        first = above[0] if above else divs[-1]
        candidates = [d for d in reversed(divs) if d <= first]  # largest first, then smaller (caps)
    if req.chunk and any(c % req.chunk for c in candidates):
        raise PlanError(f"single.micro_batch_size={req.chunk} must divide single.round_sequences={candidates[0]}")

    # -- 2./3. chunk, window, host capacity; shrink X while the window or the host cannot hold it
    overlap, overlap_reason = _overlap(req)
    host_fixed = _host_fixed(req, sizes)
    act_capacity = host_budget - sum(host_fixed.values())
    if act_capacity < 0:
        raise PlanError(
            f"host budget {gib(host_budget)} is too small: training state alone needs {gib(sum(host_fixed.values()))} "
            f"({', '.join(f'{k} {gib(v)}' for k, v in host_fixed.items())}) for {sizes.total_params / 1e9:.3f}B parameters; "
            f"raise single.host_memory_gb to >= {gib_up(sum(host_fixed.values()) * 1.05)}")
    top = _top_option(req)
    base = 0 if req.policy == "dp" else top  # the smallest slot the policy can use
    fit: _Fit | None = None
    tried: list[str] = []
    for x in candidates:
        f = _fit_round(req, sizes, hw, profiler, x, device_budget, base, cuda)
        if f is None:
            tried.append(f"X={x}: window {req.window} does not fit")
            continue
        min_acts = (L - f.window) * (x // f.chunk) * f.table.slot_bytes[base]
        if f.window >= min(2, L) and min_acts <= act_capacity:
            fit = f
            break
        tried.append(f"X={x}, chunk {f.chunk}: window {f.window}" + (
            f", saved layer inputs need {gib(min_acts)} of host" if min_acts > act_capacity else ""))
        if f.window >= 1 and min_acts <= act_capacity and x == candidates[-1]:
            fit = f
    if fit is None:
        _refuse(req, sizes, hw, profiler, device_budget, act_capacity, cuda, tried)
    assert fit is not None
    grown = False
    if not req.round_sequences and fit.window == L:
        # the whole model fits: nothing slides, so bigger rounds only cut per-round overhead
        for x in (d for d in _divisors(G) if d > fit.round_seqs and (not req.chunk or d % req.chunk == 0)):
            f = _fit_round(req, sizes, hw, profiler, x, device_budget, top, cuda)
            if f is None or f.window < L:
                break
            fit, grown = f, True
    x, chunk, table = fit.round_seqs, fit.chunk, fit.table
    chunks, rounds = x // chunk, G // x
    if not req.round_sequences:
        if grown:
            reasons.append(f"round: every block fits on the device (no weight traffic after the first load), so X grows "
                           f"past the AdaWS 3.2.2 minimum {x_min:.2f} to {x} sequences -> {rounds} rounds per step")
        elif x >= x_min:
            reasons.append(f"round: AdaWS 3.2.2 needs X >= {x_min:.2f} sequences so a block's forward hides its weight "
                           f"and gradient transfers; X={x} (smallest divisor of the global batch {G} that is large enough)"
                           f" -> {rounds} rounds per step")
        else:
            why = "the global batch is smaller" if x == G else "capped so that W >= 2 and the host holds the layer inputs"
            reasons.append(f"round: AdaWS 3.2.2 wants X >= {x_min:.2f} sequences but X={x} ({why}); weight transfers "
                           f"will not be fully hidden -> {rounds} rounds per step")
    how = "single.micro_batch_size" if req.chunk else f"largest divisor of X whose workspace {gib(table.workspace_bytes)} fits"
    reasons.append(f"chunk: {chunk} sequence(s) per chunk ({how}), {chunks} chunks per round")

    # -- 4. saved activations: for dp, try every slot size (bigger slots save more but shrink the window)
    slot_options = list(range(top + 1)) if req.policy == "dp" else [top]
    best: tuple[float, int, _Fit, list[int], dict[str, object], int] | None = None
    for m in slot_options:
        f = _fit(req, sizes, table, x, device_budget, m, cuda)
        if req.window:
            if sum(f.static.values()) + req.window * f.per_block > device_budget:
                continue
            f.window = req.window
        if f.window < 1:
            continue
        levels_m, _, info = _choose_levels(req, sizes, hw, table, f, chunks, act_capacity, max_option=m)
        predicted, _ = _predict(req, sizes, hw, table, f.window, chunks, rounds, list(levels_m) + [m] * f.window, m,
                                act_capacity, with_rows=False)
        # a window of 2+ blocks first (W = 1 cannot prefetch), then the fastest predicted step, then the wider window
        key = (f.window < min(2, L), predicted["step_s"], -f.window)
        if best is None or key < (best[2].window < min(2, L), best[0], -best[2].window):
            best = (predicted["step_s"], m, f, list(levels_m), info, f.window)
    if best is None:
        _refuse(req, sizes, hw, profiler, device_budget, act_capacity, cuda, tried + ["no activation slot size fits"])
    assert best is not None
    _, slot_level, fit, levels, sol_info, W = best
    reasons.append(
        f"window: W = (C_dev - B) / L_bytes = ({gib(device_budget)} - {gib(sum(fit.static.values()))}) / "
        f"{gib(fit.per_block)} = {W} blocks" + (" (single.window)" if req.window else "") +
        (f" (all {L} blocks fit: nothing slides)" if W == L else "") +
        (f"; activation slots sized for '{table.names[slot_level]}' (best predicted step of {len(slot_options)} sizes)"
         if len(slot_options) > 1 else ""))
    if W == 1 and L > 1:
        reasons.append("window: only 1 block fits, so a block's weights load after the previous block finished "
                       "(no prefetch overlap); more single.device_memory_gb gives W >= 2")
    reasons.append(str(sol_info["reason"]))
    full_levels = tuple(list(levels) + [slot_level] * W)

    # -- memory accounting
    tau = req.param_bytes
    dev_bytes = dict(fit.static)
    dev_bytes["weight ring"] = W * align(sizes.block_params * tau)
    dev_bytes["grad ring"] = W * align(sizes.block_params * tau)
    dev_bytes["activation ring"] = W * chunks * align(table.slot_bytes[slot_level])
    dev_bytes["total"] = sum(dev_bytes.values())
    host = dict(host_fixed)
    host["saved activations"] = int(sum(table.slot_bytes[o] for o in levels) * chunks)
    host["total"] = sum(host.values())
    reasons.append(overlap_reason)

    times, rows = _predict(req, sizes, hw, table, W, chunks, rounds, full_levels, slot_level, act_capacity)
    return SinglePlan(
        request=req, hardware=hw, sizes=sizes, chunk=chunk, chunks=chunks, rounds=rounds, window=W,
        r_param=W, r_grad=W, r_act=W * chunks, slot_level=slot_level, levels=full_levels, table=table,
        device_bytes=dev_bytes, host_bytes=host, device_budget=device_budget, host_budget=host_budget,
        overlap=overlap, feasible_no_stall=bool(sol_info["feasible"]),
        stall_s=float(sol_info["stall_s"]), times=times, policy_rows=tuple(rows), reasons=tuple(reasons),
    )


def _fit_round(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, profiler: Profiler, x: int, budget: int,
               slot_level: int, cuda: bool) -> _Fit | None:
    """Chunk, level table and window for rounds of ``x`` sequences (None if a pinned window does not fit)."""
    chunk = _choose_chunk(req, sizes, hw, profiler, x, budget, cuda)
    table = level_table(profiler(chunk), req, hw, chunk, req.model)
    f = _fit(req, sizes, table, x, budget, slot_level, cuda)
    if req.window:
        if req.window > sizes.n_blocks:
            raise PlanError(f"single.window={req.window} is more than the model's {sizes.n_blocks} blocks")
        if sum(f.static.values()) + req.window * f.per_block > budget:
            return None
        f.window = req.window
    return f


def _top_option(req: PlanRequest) -> int:
    if req.policy == "dp":
        return N_LEVELS - 1
    if req.policy == "pyao":
        return N_LEVELS  # the extra "pyao" option of the level table
    return parse_level(req.policy)


def _choose_chunk(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, profiler: Profiler, x: int,
                  budget: int, cuda: bool) -> int:
    if req.chunk:
        return req.chunk
    static_weights = 2 * align(sizes.static_params * req.param_bytes)
    room = max(0.0, (budget - static_weights) * WORKSPACE_SHARE)
    best = 1
    for b in _divisors(x):
        table = level_table(profiler(b), req, hw, b, req.model)
        if table.workspace_bytes <= room:
            best = b
    return best


def _choose_levels(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, table: LevelTable, fit: _Fit,
                   chunks: int, act_capacity: int, max_option: int | None = None,
                   ) -> tuple[list[int], int, dict[str, object]]:
    L, W = sizes.n_blocks, fit.window
    n_tr = L - W
    fwd_round = table.forward_s * chunks
    bw = hw.d2h_bytes_per_s
    if req.policy in ("dp",):
        top = N_LEVELS - 1 if max_option is None else max_option
        opts = list(range(top + 1))
        problem = SaveProblem.make(
            [fwd_round] * L,
            [[table.slot_bytes[o] / bw for o in opts]] * n_tr,
            [[table.saved_s[o] * chunks for o in opts]] * n_tr,
            ring_slots=max(1, W * chunks), chunks=chunks, transfer_layers=n_tr,
            host_bytes=[[float(table.slot_bytes[o]) for o in opts]] * n_tr, host_capacity=float(act_capacity),
        )
        sol = solve_save_levels(problem)
        levels = list(sol.levels)
        slot_level = top
        if n_tr == 0:
            reason = (f"saved activations: no block leaves the device, so every block keeps level "
                      f"'{LEVEL_NAMES[top]}' in its activation slots")
        elif not sol.feasible:
            reason = (f"saved activations: even layer inputs only cannot be drained through the ring in time "
                      f"(predicted forward stall {sol.stall_s * 1e3:.1f} ms per round): all blocks save level 0")
        else:
            avoided = sol.value / max(1e-15, n_tr * table.forward_s * chunks) if n_tr else 1.0
            counts = {LEVEL_NAMES[o]: levels.count(o) for o in sorted(set(levels))}
            reason = (f"saved activations (AdaWS DP, {n_tr} transferring blocks, ring of {W * chunks} chunk slots, "
                      f"{'exact' if sol.exact else 'thinned'}): {counts}; recompute avoided {100 * avoided:.0f}% of their "
                      f"forward; window blocks keep level '{LEVEL_NAMES[slot_level]}' on the device")
        return levels, slot_level, {"reason": reason, "feasible": sol.feasible, "stall_s": sol.stall_s}
    option = _top_option(req)
    levels = [option] * n_tr
    problem = SaveProblem.make(
        [fwd_round] * L, [[table.slot_bytes[option] / bw]] * n_tr, [[table.saved_s[option] * chunks]] * n_tr,
        ring_slots=max(1, W * chunks), chunks=chunks, transfer_layers=n_tr,
        host_bytes=[[float(table.slot_bytes[option])]] * n_tr, host_capacity=float(act_capacity),
    )
    ok, stall, _, host = simulate_forward(problem, [0] * n_tr)
    if host > act_capacity:
        raise PlanError(
            f"single.policy={req.policy}: saving '{table.names[option]}' on {n_tr} blocks needs {gib(host)} of host memory "
            f"but {gib(act_capacity)} is left after the training state; use single.policy=dp or raise single.host_memory_gb")
    name = table.names[option]
    reason = (f"saved activations: fixed '{name}' on every block (single.policy={req.policy}); predicted forward stall "
              f"{stall * 1e3:.1f} ms per round" + ("" if ok else " (the ring cannot drain it in time)"))
    return levels, option, {"reason": reason, "feasible": ok, "stall_s": stall}


def _predict(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, table: LevelTable, W: int, chunks: int,
             rounds: int, levels: Sequence[int], slot_level: int, act_capacity: int, *, with_rows: bool = True,
             ) -> tuple[dict[str, float], list[dict[str, object]]]:
    """Rough step time of a plan and of the alternative policies (what the saved-activation choice changes)."""
    L = sizes.n_blocks
    tau = req.param_bytes
    t_param = sizes.block_params * tau / hw.h2d_bytes_per_s
    t_grad = sizes.block_params * tau / hw.d2h_bytes_per_s
    fwd = table.forward_s * chunks
    n_tr = L - W

    def step_time(opts: Sequence[int]) -> tuple[float, float, float, float]:
        recompute = sum(chunks * (table.forward_s - table.saved_s[o]) for o in opts)
        offload = sum(chunks * table.slot_bytes[o] for o in opts[:n_tr])
        act_out = [chunks * table.slot_bytes[o] / hw.d2h_bytes_per_s for o in opts]
        act_in = [chunks * table.slot_bytes[o] / hw.h2d_bytes_per_s for o in opts]
        bwd = [2.0 * fwd + chunks * (table.forward_s - table.saved_s[o]) for o in opts]
        round_s, stall = simulate_round(fwd, bwd, act_out, act_in, window=W, chunks=chunks, transfer_layers=n_tr,
                                        t_param=t_param, t_grad=t_grad, fetch_grads=rounds > 1)
        return rounds * round_s, recompute * rounds, offload * rounds, stall * rounds

    step, recompute, offload, stall = step_time(levels)
    tokens = req.global_batch * req.seq_len
    times = {
        "step_s": step, "tokens_per_s": tokens / step if step > 0 else 0.0, "block_fwd_round_s": fwd,
        "t_param_s": t_param, "t_grad_s": t_grad, "recompute_s": recompute, "offload_bytes": offload, "stall_s": stall,
    }
    rows: list[dict[str, object]] = []
    if not with_rows:
        return times, rows
    options = list(range(N_LEVELS)) + ([N_LEVELS] if req.policy == "pyao" else [])
    for o in options:
        opts = [o] * n_tr + [slot_level] * W
        if sum(table.slot_bytes[o] * chunks for _ in range(n_tr)) > act_capacity:
            continue
        s, rc, off, st = step_time(opts)
        rows.append({"policy": table.names[o], "offload_bytes": off, "recompute_s": rc, "stall_s": st, "step_s": s,
                     "chosen": req.policy not in ("dp",) and o == _top_option(req)})
    if req.policy == "dp":
        rows.insert(0, {"policy": "dp", "offload_bytes": offload, "recompute_s": recompute, "stall_s": stall,
                        "step_s": step, "chosen": True})
    return times, rows


def simulate_round(fwd: float, bwd: Sequence[float], act_out: Sequence[float], act_in: Sequence[float], *,
                   window: int, chunks: int, transfer_layers: int, t_param: float, t_grad: float,
                   fetch_grads: bool) -> tuple[float, float]:
    """Time of one round (forward + backward) with serial inbound/outbound streams; returns (time, stall).

    Forward: block ``k + W`` loads into the weight slot block ``k`` frees; a chunk waits for its
    activation slot until the copy home of the unit ``R_act = W * chunks`` earlier finished.
    Backward: the last ``W`` blocks are resident; block ``j = k - W`` (weights, accumulated grads and
    saved activations) loads into the slots block ``k`` frees, once ``k``'s gradients left
    (outbound). Compute waits for whatever has not arrived: that wait is the stall.
    """
    L = len(bwd)
    R_act = max(1, window * chunks)
    t = q_in = q_out = stall = 0.0
    ready = [0.0] * L
    drained: list[float] = []
    for k in range(L):
        for c in range(chunks):
            u = k * chunks + c
            start = max(t, ready[k] if c == 0 else t, drained[u - R_act] if u >= R_act else 0.0)
            stall += start - t
            t = start + fwd / chunks
            if k < transfer_layers:
                q_out = max(q_out, t) + act_out[k] / chunks
                drained.append(q_out)
            else:
                drained.append(t)
        if k + window < L:
            q_in = max(q_in, t) + t_param
            ready[k + window] = q_in
        elif fetch_grads and k + window == L:  # weights all in: prefetch the window's gradients (AdaWS alg. 1)
            grads_ready = []
            for _ in range(min(window, L)):
                q_in = max(q_in, t) + t_grad
                grads_ready.append(q_in)
    t = max(t, q_out if transfer_layers else 0.0)  # backward needs every copy home before it refetches
    ready = [t] * L
    if fetch_grads:
        for i, k in enumerate(range(L - 1, max(-1, L - 1 - window), -1)):
            ready[k] = max(t, grads_ready[i])
    for k in range(L - 1, -1, -1):
        start = max(t, ready[k])
        stall += start - t
        t = start + bwd[k]
        q_out = max(q_out, t) + t_grad
        j = k - window
        if j >= 0:
            q_in = max(q_in, t, q_out if fetch_grads else t) + t_param + (t_grad if fetch_grads else 0.0) + (
                act_in[j] if j < transfer_layers else 0.0)
            ready[j] = q_in
    return max(t, q_out), stall


def _refuse(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, profiler: Profiler, budget: int,
            act_capacity: int, cuda: bool, tried: list[str]) -> None:
    """Raise the PlanError of a budget that is too small, with the smallest plan's needs."""
    table = level_table(profiler(1), replace(req, policy="input"), hw, 1, req.model)
    smallest = _fit(req, sizes, table, 1, budget, 0, cuda)
    need_dev = sum(smallest.static.values()) + smallest.per_block  # a window of one block
    need_two = need_dev + (smallest.per_block if sizes.n_blocks > 1 else 0)
    parts = ", ".join(f"{k} {gib(v)}" for k, v in smallest.static.items())
    L = sizes.n_blocks
    need_host = (L - 1) * table.slot_bytes[0]
    msg = [f"the model cannot train within the budgets ({'; '.join(tried)})."]
    if need_dev > budget:
        msg.append(
            f"Device: the smallest plan (1 sequence per round, a window of 1 block, layer inputs only) needs "
            f"{gib(need_dev)} = {parts} + {gib(smallest.per_block)} per block (weights + grads + activation slot), "
            f"and a window of 2 blocks (weights prefetched during compute) needs {gib(need_two)}; "
            f"single.device_memory_gb gives {gib(budget)}. Raise single.device_memory_gb to >= "
            f"{gib_up(need_dev)} (>= {gib_up(need_two)} to overlap), "
            f"or shorten train.seq_len")
    if need_host > act_capacity:
        msg.append(f"Host: the layer inputs of one sequence need {gib(need_host)} but only {gib(max(0, act_capacity))} is left "
                   f"after the training state; raise single.host_memory_gb")
    raise PlanError(" ".join(msg))


def plan_request_from_config(cfg: object, single: object, model_cfg: ModelConfig) -> PlanRequest:
    """A :class:`PlanRequest` from a job config (``SysxConfig``) and its ``single`` section."""
    t = cfg.train  # type: ignore[attr-defined]
    gb = single.device_memory_gb  # type: ignore[attr-defined]
    hb = single.host_memory_gb  # type: ignore[attr-defined]
    return PlanRequest(
        model=model_cfg, seq_len=t.seq_len, global_batch=t.micro_batch_size * t.micro_batches,
        precision=cfg.precision,  # type: ignore[attr-defined]
        device_budget_bytes=int(gb * GiB) if gb else None, host_budget_bytes=int(hb * GiB) if hb else None,
        chunk=single.micro_batch_size, round_sequences=single.round_sequences,  # type: ignore[attr-defined]
        window=single.window, policy=str(single.policy), compress=bool(single.compress),  # type: ignore[attr-defined]
        grad_clip=float(cfg.optim.grad_clip), optimizer_overlap=single.optimizer_overlap,  # type: ignore[attr-defined]
    )
