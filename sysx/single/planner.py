"""Automatic configuration of the sliding-window executor (AdaWS §3.2, appendix B) under hard budgets.

:func:`make_plan` decides, from the model, sequence length, global batch, precision, hardware figures
and device/host budgets: the sequences per round, the chunk and sequence-chunk sizes, the window and
ring sizes, the saved activations of each block and the optimizer overlap. A plan that cannot fit
raises :class:`PlanError` before anything is allocated, with the bytes needed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NoReturn

import torch

from sysx.machine.hardware import GiB, HardwareProfile
from sysx.memory.budget import grad_scratch_buffers, staging_bytes, training_state_bytes
from sysx.model.config import ModelConfig
from sysx.single.act_capture import kept_graph_layout
from sysx.single.lanes import WORKERS
from sysx.single.op_profile import Profiler
from sysx.single.plan_costs import LevelTable, level_table, meta_profiler, predict_step
from sysx.single.plan_levels import SaveChoice, choose_save_levels, kept_graph_reason, kept_graph_unit_bytes
from sysx.single.plan_report import SinglePlan
from sysx.single.plan_request import ModelSizes, PlanError, PlanRequest, gib, gib_up
from sysx.single.plan_seq import choose_seq_chunk, kv_cache_bytes
from sysx.single.rings import align

CUDA_RESERVE = 256 * 1024**2  # cuBLAS / attention workspaces and allocator rounding on a GPU
WORKSPACE_SHARE = 0.25  # a chunk's transient workspace may use this share of the budget left


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def min_round_sequences(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile) -> float:
    """AdaWS §3.2.2: the smallest ``X`` whose block forward hides the weight and gradient transfers."""
    cfg = req.model
    d_attn = cfg.n_heads * cfg.head_dim
    tau = req.param_bytes
    bw = hw.link_bytes_per_s
    return (
        (tau + tau)
        * sizes.block_params
        * hw.matmul_flops_per_s
        / (2.0 * req.seq_len * (sizes.block_active + req.seq_len * d_attn) * bw)
    )


@dataclass
class _Fit:
    round_seqs: int
    chunk: int
    window: int
    table: LevelTable
    static: dict[str, int]
    per_block: int
    slot_level: int
    keep_graph: bool = False  # every block keeps its forward's autograd graph (see kept_graph_unit_bytes)


def _static_device(
    req: PlanRequest, sizes: ModelSizes, table: LevelTable, round_seqs: int, cuda: bool
) -> dict[str, int]:
    tau = req.param_bytes
    cfg = req.model
    return {
        "embedding+head weights": align(sizes.static_params * tau),
        "embedding+head grads": align(sizes.static_params * tau),
        "transitions": align(round_seqs * req.seq_len * cfg.dim * tau),
        **kv_cache_bytes(req, table.chunk, table.seq_chunk),
        "workspace (est.)": int(table.workspace_bytes * 1.1) + (CUDA_RESERVE if cuda else 0),
    }


def _fit(
    req: PlanRequest, sizes: ModelSizes, table: LevelTable, round_seqs: int, budget: int, slot_level: int, cuda: bool
) -> _Fit:
    """The window of blocks that fits ``budget`` with activation slots sized for ``slot_level``; when
    every block then fits by keeping its graph (:func:`kept_graph_unit_bytes`), that fit."""
    L = sizes.n_blocks
    units = table.units(round_seqs // table.chunk, req.seq_len)
    static = _static_device(req, sizes, table, round_seqs, cuda)
    weights_grads = align(sizes.block_params * req.param_bytes) * 2
    free = budget - sum(static.values())

    def window(per_block: int) -> int:
        return int(min(L, max(0, free // per_block))) if free > 0 else 0

    kept = kept_graph_unit_bytes(req, table, slot_level)
    if kept is not None and (not req.window or req.window == L):
        per_block = weights_grads + units * kept
        if window(per_block) == L:
            return _Fit(round_seqs, table.chunk, L, table, static, per_block, slot_level, keep_graph=True)
    per_block = weights_grads + units * align(table.slot_bytes[slot_level])
    return _Fit(round_seqs, table.chunk, window(per_block), table, static, per_block, slot_level)


# 16-bit groups convert their gradients to fp32 per optimizer job into buffers of the largest group,
# one per job in flight: the two optimizer workers and the trainer's thread (the device lane)
GRAD_SCRATCH_BUFFERS = grad_scratch_buffers(WORKERS)


def _host_fixed(req: PlanRequest, sizes: ModelSizes) -> dict[str, int]:
    n = sizes.total_params
    state = training_state_bytes(req.dtype, grad_dtype=req.dtype, offload=req.offload)
    out = {name: per * n for name, per in state.rows().items()}
    if req.offload == "nvme":  # the master, m and v are in files; one staging pool of the largest group
        out["nvme staging"] = staging_bytes(max(sizes.block_params, sizes.static_params), req.dtype, workers=WORKERS)
    if req.precision != "fp32":
        out["fp32 grad scratch"] = 4 * max(sizes.block_params, sizes.static_params) * GRAD_SCRATCH_BUFFERS
    return out


def _overlap(req: PlanRequest) -> tuple[str, str]:
    """The optimizer overlap mode and why (CpuAdam's arithmetic undo makes speculation free of memory)."""
    can_veto = req.grad_clip > 0 or req.precision == "fp16"
    veto = (
        (f"grad_clip={req.grad_clip:g}" if req.grad_clip > 0 else "")
        + (" and " if req.grad_clip > 0 and req.precision == "fp16" else "")
        + ("fp16 overflow" if req.precision == "fp16" else "")
    )
    if req.optimizer_overlap == "forward":
        return "forward", (
            "optimizer: blocks step after the global norm is known, in forward order, overlapped with the "
            "next step's forward (single.optimizer_overlap=forward)"
        )
    if not can_veto:
        return "backward", (
            "optimizer: each block's CPU Adam steps as soon as its gradients are home, during the "
            "backward pass (nothing can veto a step)"
        )
    if req.optimizer_overlap == "backward":
        return "backward", (
            f"optimizer: each block steps as soon as its gradients are home (single.optimizer_overlap="
            f"backward); when {veto} vetoes the step it is undone (CpuAdam.undo, no extra memory) and redone"
        )
    return "auto", (
        f"optimizer: blocks step as soon as their gradients are home while recent steps passed the "
        f"{veto} check (undone and redone if this one does not); after a step that needed it, steps wait for the "
        f"global norm (overlapped with the following forward) until optim.speculate_after clean ones passed"
    )


def make_plan(req: PlanRequest, hw: HardwareProfile, *, profiler: Profiler | None = None) -> SinglePlan:
    """Decide the configuration (see docs/architecture.md) or raise :class:`PlanError` with the numbers."""
    sizes = ModelSizes.of(req.model)
    cuda = hw.kind == "cuda"
    profiler = profiler or meta_profiler(req.model, req.seq_len, req.dtype, count_graph=req.keep_graph)
    device_budget = int(req.device_budget_bytes if req.device_budget_bytes else hw.device_free_bytes)
    host_budget = int(req.host_budget_bytes if req.host_budget_bytes else hw.host_free_bytes)
    if req.seq_len < 1 or req.global_batch < 1:
        raise PlanError(f"seq_len={req.seq_len} and global batch={req.global_batch} must be >= 1")
    reasons: list[str] = []

    # -- 1. sequences per round; the sequence chunk
    x_min = min_round_sequences(req, sizes, hw)
    candidates = _round_candidates(req, x_min, reasons)
    sizer = _sizer(req.model, req.seq_len, req.dtype)
    seq_chunk, seq_reason = choose_seq_chunk(
        req,
        lambda b, c: level_table(sizer(b, c), req, hw, b, req.model),
        _workspace_room(req, sizes, budget=device_budget),
    )
    req = replace(req, seq_chunk=seq_chunk)  # pinned from here on

    # -- 2./3. chunk, window, host capacity; shrink X while the window or the host cannot hold it
    overlap, overlap_reason = _overlap(req)
    host_fixed = _host_fixed(req, sizes)
    act_capacity = host_budget - sum(host_fixed.values())
    if act_capacity < 0:
        raise PlanError(_host_shortage(req, hw, sizes, host_budget, host_fixed))
    fit, tried = _first_fit(req, sizes, hw, profiler, candidates, device_budget, act_capacity, cuda)
    fit, grown = _grow_round(req, sizes, hw, profiler, fit, device_budget, cuda)
    x, chunk, table = fit.round_seqs, fit.chunk, fit.table
    chunks, rounds = x // chunk, req.global_batch // x
    units = table.units(chunks, req.seq_len)
    if not req.round_sequences:
        reasons.append(_round_reason(req, x_min, x, rounds, grown))
    reasons += [_chunk_reason(req, table, chunk, chunks), seq_reason]

    # -- 4. saved activations
    slot_options = list(range(req.top_option + 1)) if req.policy == "dp" else [req.top_option]
    best = _best_slot(req, sizes, hw, table, x, rounds, slot_options, device_budget, act_capacity, cuda)
    if best is None:
        _refuse(req, sizes, hw, profiler, device_budget, act_capacity, cuda, tried + ["no activation slot size fits"])
    fit, slot_level, levels, W = best.fit, best.slot_level, best.levels, best.fit.window
    reasons += _window_reasons(req, sizes, best, device_budget, len(slot_options))
    reasons.append(kept_graph_reason(table, units) if fit.keep_graph else str(best.info["reason"]))
    full_levels = tuple(list(levels) + [slot_level] * W)

    # -- memory accounting
    dev_bytes = _device_bytes(req, sizes, fit, units)
    host = _host_bytes(host_fixed, table, levels, units)
    reasons.append(overlap_reason)

    times, rows = predict_step(req, sizes, hw, table, W, units, rounds, full_levels, slot_level, act_capacity)
    return SinglePlan(
        request=req,
        hardware=hw,
        sizes=sizes,
        chunk=chunk,
        chunks=chunks,
        seq_chunk=seq_chunk,
        rounds=rounds,
        window=W,
        r_param=W,
        r_grad=W,
        r_act=W * units,
        slot_level=slot_level,
        levels=full_levels,
        table=table,
        device_bytes=dev_bytes,
        host_bytes=host,
        device_budget=device_budget,
        host_budget=host_budget,
        overlap=overlap,
        feasible_no_stall=bool(best.info["feasible"]),
        stall_s=float(best.info["stall_s"]),
        times=times,
        policy_rows=tuple(rows),
        reasons=tuple(reasons),
        keep_graph=fit.keep_graph,
    )


def _chunk_reason(req: PlanRequest, table: LevelTable, chunk: int, chunks: int) -> str:
    how = (
        "single.micro_batch_size"
        if req.chunk
        else f"largest divisor of X whose workspace {gib(table.workspace_bytes)} fits"
    )
    return f"chunk: {chunk} sequence(s) per chunk ({how}), {chunks} chunks per round"


def _host_bytes(fixed: dict[str, int], table: LevelTable, levels: list[int], units: int) -> dict[str, int]:
    """Host memory by use: the training state, the saved activations of the transferring blocks, the total."""
    host = dict(fixed)
    host["saved activations"] = int(sum(table.slot_bytes[o] for o in levels) * units)
    host["total"] = sum(host.values())
    return host


def _round_candidates(req: PlanRequest, x_min: float, reasons: list[str]) -> list[int]:
    """Step 1: the round sizes ``X`` to try, preferred first (a pinned one, else the smallest divisor
    of the global batch at least ``x_min`` and then the smaller ones)."""
    G = req.global_batch
    if req.round_sequences:
        if G % req.round_sequences:
            raise PlanError(
                f"single.round_sequences={req.round_sequences} must divide the global batch {G} "
                f"(train.micro_batch_size x train.micro_batches); divisors: {_divisors(G)}"
            )
        candidates = [req.round_sequences]
        reasons.append(
            f"round: {req.round_sequences} sequences per round (single.round_sequences); AdaWS 3.2.2 would "
            f"want >= {x_min:.2f}"
        )
    else:
        divs = [d for d in _divisors(G) if not req.chunk or d % req.chunk == 0]
        if not divs:
            raise PlanError(
                f"single.micro_batch_size={req.chunk} must divide the global batch {G}; divisors: {_divisors(G)}"
            )
        above = [d for d in divs if d >= x_min]
        first = above[0] if above else divs[-1]
        candidates = [d for d in reversed(divs) if d <= first]  # largest first, then smaller (caps)
    if req.chunk and any(c % req.chunk for c in candidates):
        raise PlanError(f"single.micro_batch_size={req.chunk} must divide single.round_sequences={candidates[0]}")
    return candidates


def _first_fit(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    profiler: Profiler,
    candidates: list[int],
    budget: int,
    act_capacity: int,
    cuda: bool,
) -> tuple[_Fit, list[str]]:
    """Steps 2-3: the first round size whose window holds 2 blocks (1 for the last resort) and whose
    saved layer inputs fit the host; the attempts that failed, for a refusal."""
    L = sizes.n_blocks
    base = 0 if req.policy == "dp" else req.top_option  # the smallest slot the policy can use
    fit: _Fit | None = None
    tried: list[str] = []
    for x in candidates:
        f = _fit_round(req, sizes, hw, profiler, x, budget, base, cuda)
        if f is None:
            tried.append(f"X={x}: window {req.window} does not fit")
            continue
        min_acts = (L - f.window) * f.table.units(x // f.chunk, req.seq_len) * f.table.slot_bytes[base]
        if f.window >= min(2, L) and min_acts <= act_capacity:
            return f, tried
        tried.append(
            f"X={x}, chunk {f.chunk}: window {f.window}"
            + (f", saved layer inputs need {gib(min_acts)} of host" if min_acts > act_capacity else "")
        )
        if f.window >= 1 and min_acts <= act_capacity and x == candidates[-1]:
            fit = f
    if fit is None:
        _refuse(req, sizes, hw, profiler, budget, act_capacity, cuda, tried)
    assert fit is not None
    return fit, tried


def _grow_round(
    req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, profiler: Profiler, fit: _Fit, budget: int, cuda: bool
) -> tuple[_Fit, bool]:
    """When the whole model fits, nothing slides, so bigger rounds only cut per-round overhead:
    grow ``X`` while every block still fits. Returns the fit and whether it grew."""
    L = sizes.n_blocks
    if req.round_sequences or fit.window != L:
        return fit, False
    grown = False
    for x in (d for d in _divisors(req.global_batch) if d > fit.round_seqs and (not req.chunk or d % req.chunk == 0)):
        f = _fit_round(req, sizes, hw, profiler, x, budget, req.top_option, cuda)
        if f is None or f.window < L:
            break
        fit, grown = f, True
    return fit, grown


def _round_reason(req: PlanRequest, x_min: float, x: int, rounds: int, grown: bool) -> str:
    """Why an automatic round has ``x`` sequences."""
    if grown:
        return (
            f"round: every block fits on the device (no weight traffic after the first load), so X grows "
            f"past the AdaWS 3.2.2 minimum {x_min:.2f} to {x} sequences -> {rounds} rounds per step"
        )
    if x >= x_min:
        return (
            f"round: AdaWS 3.2.2 needs X >= {x_min:.2f} sequences so a block's forward hides its weight "
            f"and gradient transfers; X={x} (smallest divisor of the global batch {req.global_batch} that is large "
            f"enough) -> {rounds} rounds per step"
        )
    why = (
        "the global batch is smaller"
        if x == req.global_batch
        else "capped so that W >= 2 and the host holds the layer inputs"
    )
    return (
        f"round: AdaWS 3.2.2 wants X >= {x_min:.2f} sequences but X={x} ({why}); weight transfers "
        f"will not be fully hidden -> {rounds} rounds per step"
    )


@dataclass(frozen=True)
class _SlotCandidate:
    """One activation-slot size tried in step 4: its window, the levels of the transferring blocks
    and the predicted step time."""

    step_s: float
    slot_level: int
    fit: _Fit
    levels: list[int]
    info: SaveChoice

    def rank(self, n_blocks: int) -> tuple[bool, float, int]:
        """Better is smaller: a window of 2+ blocks first (W = 1 cannot prefetch), then the fastest
        predicted step, then the wider window."""
        return (self.fit.window < min(2, n_blocks), self.step_s, -self.fit.window)


def _best_slot(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    table: LevelTable,
    x: int,
    rounds: int,
    slot_options: list[int],
    budget: int,
    act_capacity: int,
    cuda: bool,
) -> _SlotCandidate | None:
    """Step 4: for dp, every slot size (bigger slots save more but shrink the window); the best
    candidate, or None when no slot size fits."""
    units = table.units(x // table.chunk, req.seq_len)
    best: _SlotCandidate | None = None
    for m in slot_options:
        f = _fit(req, sizes, table, x, budget, m, cuda)
        if req.window:
            if sum(f.static.values()) + req.window * f.per_block > budget:
                continue
            f.window = req.window
        if f.window < 1:
            continue
        levels_m, _, info = choose_save_levels(req, sizes, hw, table, f.window, units, act_capacity, max_option=m)
        predicted, _ = predict_step(
            req,
            sizes,
            hw,
            table,
            f.window,
            units,
            rounds,
            list(levels_m) + [m] * f.window,
            m,
            act_capacity,
            with_rows=False,
        )
        candidate = _SlotCandidate(predicted["step_s"], m, f, list(levels_m), info)
        if best is None or candidate.rank(sizes.n_blocks) < best.rank(sizes.n_blocks):
            best = candidate
    return best


def _window_reasons(
    req: PlanRequest, sizes: ModelSizes, best: _SlotCandidate, budget: int, n_options: int
) -> list[str]:
    """Why the window has its size (and what one block of window costs)."""
    L, W, fit = sizes.n_blocks, best.fit.window, best.fit
    reasons = [
        f"window: W = (C_dev - B) / L_bytes = ({gib(budget)} - {gib(sum(fit.static.values()))}) / "
        f"{gib(fit.per_block)} = {W} blocks"
        + (" (single.window)" if req.window else "")
        + (f" (all {L} blocks fit: nothing slides)" if W == L else "")
        + (
            f"; activation slots sized for '{fit.table.names[best.slot_level]}' (best predicted step of {n_options} sizes)"
            if n_options > 1
            else ""
        )
    ]
    if W == 1 and L > 1:
        reasons.append(
            "window: only 1 block fits, so a block's weights load after the previous block finished "
            "(no prefetch overlap); more single.device_memory_gb gives W >= 2"
        )
    return reasons


def _device_bytes(req: PlanRequest, sizes: ModelSizes, fit: _Fit, units: int) -> dict[str, int]:
    """Device memory of the plan: the static buffers and the three rings (``units`` per block per
    round; with kept graphs an activation slot holds the layer input and what the graph saved)."""
    tau, W = req.param_bytes, fit.window
    dev_bytes = dict(fit.static)
    dev_bytes["weight ring"] = W * align(sizes.block_params * tau)
    dev_bytes["grad ring"] = W * align(sizes.block_params * tau)
    table = fit.table
    slot = kept_graph_layout(table.profile).nbytes if fit.keep_graph else table.slot_bytes[fit.slot_level]
    dev_bytes["activation ring"] = W * units * align(slot)
    dev_bytes["total"] = sum(dev_bytes.values())
    return dev_bytes


def _fit_round(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    profiler: Profiler,
    x: int,
    budget: int,
    slot_level: int,
    cuda: bool,
) -> _Fit | None:
    """Chunk, level table and window for rounds of ``x`` sequences (None if a pinned window does not fit)."""
    chunk = _choose_chunk(req, sizes, hw, profiler, x, budget, cuda)
    table = level_table(profiler(chunk, req.seq_chunk), req, hw, chunk, req.model)
    f = _fit(req, sizes, table, x, budget, slot_level, cuda)
    if req.window:
        if req.window > sizes.n_blocks:
            raise PlanError(f"single.window={req.window} is more than the model's {sizes.n_blocks} blocks")
        if sum(f.static.values()) + req.window * f.per_block > budget:
            return None
        f.window = req.window
    return f


def _choose_chunk(
    req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, profiler: Profiler, x: int, budget: int, cuda: bool
) -> int:
    """The largest divisor of ``x`` whose workspace fits :data:`WORKSPACE_SHARE` of the budget left.

    Sizes come from exact byte counts (a ``meta`` profile: no memory, no time); only the size
    chosen is then run by ``profiler`` (on the training device), and a size the device runs out
    of memory on does not fit: the next smaller one is tried.
    """
    C = req.seq_chunk
    if req.chunk:
        if not _runs_on_device(profiler, req.chunk, C):
            raise PlanError(
                f"single.micro_batch_size={req.chunk}: the device ran out of memory running one block on "
                f"{req.chunk} sequence(s) of {C} tokens while planning; lower it"
            )
        return req.chunk
    sizer = _sizer(req.model, req.seq_len, req.dtype)
    room = _workspace_room(req, sizes, budget)
    divisors = _divisors(x)
    fitting = [b for b in divisors if level_table(sizer(b, C), req, hw, b, req.model).workspace_bytes <= room]
    first = fitting[-1] if fitting else 1
    for b in (d for d in reversed(divisors) if d <= first):
        if _runs_on_device(profiler, b, C):
            return b
    raise PlanError(
        f"the device ran out of memory running one block on 1 sequence of {C} tokens while planning; "
        f"lower single.seq_chunk, shorten train.seq_len or free device memory (other processes on the GPU?)"
    )


def _workspace_room(req: PlanRequest, sizes: ModelSizes, budget: int) -> float:
    """What a unit's transient workspace may use: :data:`WORKSPACE_SHARE` of the budget left after the
    embedding and head weights and gradients."""
    static_weights = 2 * align(sizes.static_params * req.param_bytes)
    return max(0.0, (budget - static_weights) * WORKSPACE_SHARE)


@functools.lru_cache(maxsize=8)
def _sizer(cfg: ModelConfig, seq_len: int, dtype: torch.dtype) -> Profiler:
    """The ``meta`` profiler of a shape (cached: every round size asks for the same chunk sizes)."""
    return meta_profiler(cfg, seq_len, dtype)


def _runs_on_device(profiler: Profiler, chunk: int, seq_chunk: int) -> bool:
    """Profile ``chunk`` sequences of ``seq_chunk`` tokens; False when the device runs out of memory doing it."""
    try:
        profiler(chunk, seq_chunk)
        return True
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    # emptied outside the except block: its traceback still holds the failed attempt's tensors
    if out_of_memory and torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the failed attempt's blocks back before the next size
    return False


def _refuse(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    profiler: Profiler,
    budget: int,
    act_capacity: int,
    cuda: bool,
    tried: list[str],
) -> NoReturn:
    """Raise the PlanError of a budget that is too small, with the smallest plan's needs."""
    C = req.seq_chunk or req.seq_len
    table = level_table(_sizer(req.model, req.seq_len, req.dtype)(1, C), replace(req, policy="input"), hw, 1, req.model)
    smallest = _fit(req, sizes, table, 1, budget, 0, cuda)
    need_dev = sum(smallest.static.values()) + smallest.per_block  # a window of one block
    need_two = need_dev + (smallest.per_block if sizes.n_blocks > 1 else 0)
    parts = ", ".join(f"{k} {gib(v)}" for k, v in smallest.static.items())
    L = sizes.n_blocks
    need_host = (L - 1) * table.slot_bytes[0]
    msg = [f"the model cannot train within the budgets ({'; '.join(tried)})."]
    if need_dev > budget:
        msg.append(
            "Device: the smallest plan (1 sequence per round"
            + (f" in chunks of {C} tokens" if req.seq_len > C else "")
            + ", a window of 1 block, layer inputs only) needs "
            f"{gib(need_dev)} = {parts} + {gib(smallest.per_block)} per block (weights + grads + activation slot), "
            f"and a window of 2 blocks (weights prefetched during compute) needs {gib(need_two)}; "
            f"single.device_memory_gb gives {gib(budget)}. Raise single.device_memory_gb to >= "
            f"{gib_up(need_dev)} (>= {gib_up(need_two)} to overlap), "
            f"or shorten train.seq_len"
            + (
                " or chunk it (single.seq_chunk: tokens per sequence chunk, a divisor of train.seq_len)"
                if req.seq_len == C
                else " or lower single.seq_chunk"
            )
        )
    if need_host > act_capacity:
        msg.append(
            f"Host: the layer inputs of one sequence need {gib(need_host)} but only {gib(max(0, act_capacity))} is left "
            f"after the training state; raise single.host_memory_gb"
        )
    raise PlanError(" ".join(msg))


def _host_shortage(req: PlanRequest, hw: HardwareProfile, sizes: ModelSizes, budget: int, fixed: dict[str, int]) -> str:
    """Why the training state does not fit the host budget, and the fix this machine allows: a larger
    ``single.host_memory_gb`` only while the machine has that much free, else a smaller model or a larger machine."""
    need = sum(fixed.values())
    state = (
        f"training state alone needs {gib(need)} ({', '.join(f'{k} {gib(v)}' for k, v in fixed.items())}) "
        f"for {sizes.total_params / 1e9:.3f}B parameters"
    )
    wanted = gib_up(need * 1.05)
    if req.host_budget_bytes and float(wanted) * GiB <= hw.host_free_bytes:
        return (
            f"host budget {gib(budget)} (single.host_memory_gb={req.host_budget_bytes / GiB:g}) is too small: {state}; "
            f"raise single.host_memory_gb to >= {wanted}"
        )
    return (
        f"host budget {gib(budget)} is too small: {state}, and this machine has {gib(hw.host_free_bytes)} of host "
        f"memory free; use a smaller model (model=...), or a machine with >= {wanted} GiB free"
    )
