"""What each activation save level costs a block: slot bytes, recompute avoided, workspace
(:class:`LevelTable`, from a layer profile and the hardware), and the predicted step time of a
window (:func:`predict_step`, :func:`simulate_round`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from sysx.machine.hardware import HardwareProfile
from sysx.model.config import ModelConfig
from sysx.model.loss import loss_workspace_bytes
from sysx.single.act_capture import SlotLayout
from sysx.single.act_policy import LEVEL_NAMES, N_LEVELS, pyao_recompute_mask
from sysx.single.op_profile import LayerProfile, Profiler, profile_cache, profile_layer
from sysx.single.plan_request import ModelSizes, PlanRequest


class PolicyRow(TypedDict):
    """Predicted cost per step of one saved-activation policy (a row of the plan's comparison table)."""

    policy: str
    offload_bytes: float
    recompute_s: float
    stall_s: float
    step_s: float
    chosen: bool


def meta_profiler(cfg: ModelConfig, seq_len: int, dtype: torch.dtype, *, count_graph: bool = False) -> Profiler:
    """Profile one Block on ``b`` sequences of ``C`` tokens on the ``meta`` device (exact bytes, no
    memory, no time); ``count_graph``: with the bytes a kept graph packs."""
    return lambda b, seq_chunk: meta_layer_profile(cfg, seq_len, dtype, b, seq_chunk, count_graph)


@functools.lru_cache(maxsize=1024)
def meta_layer_profile(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, b: int, seq_chunk: int, count_graph: bool = False
) -> LayerProfile:
    """One Block's ``meta`` profile. It depends on the shapes alone (no weights, no clock), so one
    per process serves every plan made in it: a sweep's points, the tuner's candidates, a restart."""
    from sysx.model.llama import make_layer

    block = make_layer(cfg, 1, dtype=dtype, device="meta")
    x = torch.empty((b, min(seq_chunk, seq_len), cfg.dim), dtype=dtype, device="meta")
    kv = profile_cache(cfg, b, seq_len, seq_chunk, dtype, "meta")
    return profile_layer(block, x, model_dim=cfg.dim, kv=kv, count_graph=count_graph)


@dataclass(frozen=True)
class LevelTable:
    """Costs of one block on one *unit* (``chunk`` sequences x ``seq_chunk`` tokens: a chunk, or one
    sequence chunk of it) at every save option (levels 0..4, plus ``pyao`` when asked)."""

    chunk: int
    slot_bytes: tuple[int, ...]  # bytes a unit's slot holds at each option
    saved_s: tuple[float, ...]  # recompute time avoided per unit at each option
    forward_s: float  # forward time of one unit through one block
    names: tuple[str, ...]
    layouts: tuple[SlotLayout, ...]
    workspace_bytes: int  # transient memory of a unit's backward (recompute + autograd) or of the head
    profile: LayerProfile  # the block profile the layouts index into
    seq_chunk: int  # tokens of a unit (train.seq_len when sequences are not chunked)
    backward_extra_s: float  # a sequence chunk's backward beyond 2x forward: attention re-run, K/V rebuilt
    head_s: float = 0.0  # one chunk's Head forward and backward (final norm, output projection, loss)
    # a unit's backward with nothing to recompute, in forwards: 2 by FLOPs (the input and weight
    # gradients); a measured table (:mod:`sysx.single.pass_timing`) has the device's own ratio
    backward_ratio: float = 2.0

    def units(self, chunks: int, seq_len: int) -> int:
        """Units per block per round: ``chunks`` chunks of ``seq_len / seq_chunk`` sequence chunks each."""
        return chunks * (seq_len // self.seq_chunk)


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


def pyao_sites(
    profile: LayerProfile, times: Sequence[float], hw: HardwareProfile
) -> tuple[frozenset[int], list[float], list[bool]]:
    """PyAO's choice for a block: every site saved except IQR-outlier throughput sites faster than the link."""
    throughput = [s.nbytes / max(t, 1e-15) for s, t in zip(profile.sites, times)]
    mask = pyao_recompute_mask(throughput, hw.d2h_bytes_per_s)
    keep = frozenset(s.index for s, out in zip(profile.sites, mask) if not out)
    return keep, throughput, mask


def level_table(
    profile: LayerProfile, req: PlanRequest, hw: HardwareProfile, chunk: int, cfg: ModelConfig
) -> LevelTable:
    """Slot bytes, recompute avoided and workspace of each option for units of ``chunk`` sequences (of
    the tokens ``profile`` ran on: whole sequences or sequence chunks)."""
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
    ws_head = loss_workspace_bytes(chunk * req.seq_len, cfg.vocab_size, cfg.dim, req.dtype)  # whole sequences
    seq_chunk = profile.input.shape[1]
    extra = 0.0
    if (
        seq_chunk < req.seq_len
    ):  # chunk_attention's backward runs its forward again; norm + K/V projections rebuild the cache
        kv_flops = 2.0 * chunk * seq_chunk * cfg.dim * 2 * cfg.n_kv_heads * cfg.head_dim
        extra = (
            sum(t for s, t in zip(profile.sites, times) if s.category == "attention") + kv_flops / hw.matmul_flops_per_s
        )
    return LevelTable(
        chunk,
        tuple(layout.nbytes for layout in layouts),
        tuple(saved),
        float(sum(times)),
        tuple(names),
        tuple(layouts),
        int(max(ws_block, ws_head)),
        profile,
        seq_chunk,
        extra,
        head_seconds(chunk * req.seq_len, cfg, hw),
    )


def head_seconds(tokens: int, cfg: ModelConfig, hw: HardwareProfile) -> float:
    """The Head's forward and backward on ``tokens`` tokens by the site rules: the output
    projection's three matmuls (logits, input and weight gradients) at the matmul rate, and the
    fp32 logits written and read three times in each direction (softmax, loss, their gradients)."""
    matmuls = 3 * 2.0 * tokens * cfg.dim * cfg.vocab_size / hw.matmul_flops_per_s
    logits = 2 * 3.0 * tokens * cfg.vocab_size * 4 / hw.device_mem_bytes_per_s
    return matmuls + logits


def predict_step(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    table: LevelTable,
    W: int,
    units: int,
    rounds: int,
    levels: Sequence[int],
    slot_level: int,
    act_capacity: int,
    *,
    with_rows: bool = True,
) -> tuple[dict[str, float], list[PolicyRow]]:
    """Rough step time of a plan and of the alternative policies (what the saved-activation choice changes);
    ``units`` is units per block per round (:meth:`LevelTable.units`)."""
    L = sizes.n_blocks
    tau = req.param_bytes
    t_param = sizes.block_params * tau / hw.h2d_bytes_per_s
    t_grad = sizes.block_params * tau / hw.d2h_bytes_per_s
    fwd = table.forward_s * units
    n_tr = L - W
    host = round_host_s(hw, L, units)
    head = table.head_s * (units * table.seq_chunk // req.seq_len)  # once per chunk of whole sequences

    def step_time(opts: Sequence[int]) -> tuple[float, float, float, float]:
        recompute = sum(units * (table.forward_s - table.saved_s[o]) for o in opts)
        offload = sum(units * table.slot_bytes[o] for o in opts[:n_tr])
        act_out = [units * table.slot_bytes[o] / hw.d2h_bytes_per_s for o in opts]
        act_in = [units * table.slot_bytes[o] / hw.h2d_bytes_per_s for o in opts]
        bwd = [
            table.backward_ratio * fwd + units * (table.forward_s - table.saved_s[o] + table.backward_extra_s)
            for o in opts
        ]
        round_s, stall = simulate_round(
            fwd,
            bwd,
            act_out,
            act_in,
            window=W,
            chunks=units,
            transfer_layers=n_tr,
            t_param=t_param,
            t_grad=t_grad,
            fetch_grads=rounds > 1,
        )
        return rounds * (round_s + head + host), recompute * rounds, offload * rounds, stall * rounds

    step, recompute, offload, stall = step_time(levels)
    tokens = req.global_batch * req.seq_len
    times = {
        "step_s": step,
        "tokens_per_s": tokens / step if step > 0 else 0.0,
        "block_fwd_round_s": fwd,
        "t_param_s": t_param,
        "t_grad_s": t_grad,
        "recompute_s": recompute,
        "offload_bytes": offload,
        "stall_s": stall,
        "host_ops_s": rounds * host,
        "head_s": rounds * head,
    }
    if not with_rows:
        return times, []
    rows = _policy_rows(req, table, n_tr, W, units, slot_level, act_capacity, step_time)
    if req.policy == "dp":
        rows.insert(
            0,
            PolicyRow(
                policy="dp", offload_bytes=offload, recompute_s=recompute, stall_s=stall, step_s=step, chosen=True
            ),
        )
    return times, rows


def round_host_s(hw: HardwareProfile, n_blocks: int, units: int) -> float:
    """The executor's fixed host cost of one round (``hw.op_host_s`` per step it takes): every
    block's forward and backward of each unit, and its weight load, gradient fetch and gradient
    send, each a Python step the layer times leave out; on the compute stream's path, so serial."""
    return hw.op_host_s * n_blocks * (2 * units + 3)


def _policy_rows(
    req: PlanRequest,
    table: LevelTable,
    n_tr: int,
    W: int,
    units: int,
    slot_level: int,
    act_capacity: int,
    step_time: Callable[[Sequence[int]], tuple[float, float, float, float]],
) -> list[PolicyRow]:
    """The step with every transferring block at one fixed save level, for each level whose saved
    activations fit the host (and PyAO's mask when it is the policy)."""
    rows = []
    options = list(range(N_LEVELS)) + ([N_LEVELS] if req.policy == "pyao" else [])
    for o in options:
        opts = [o] * n_tr + [slot_level] * W
        if sum(table.slot_bytes[o] * units for _ in range(n_tr)) > act_capacity:
            continue
        s, rc, off, st = step_time(opts)
        chosen = req.policy not in ("dp",) and o == req.top_option
        rows.append(
            PolicyRow(policy=table.names[o], offload_bytes=off, recompute_s=rc, stall_s=st, step_s=s, chosen=chosen)
        )
    return rows


def simulate_round(
    fwd: float,
    bwd: Sequence[float],
    act_out: Sequence[float],
    act_in: Sequence[float],
    *,
    window: int,
    chunks: int,
    transfer_layers: int,
    t_param: float,
    t_grad: float,
    fetch_grads: bool,
) -> tuple[float, float]:
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
            q_in = (
                max(q_in, t, q_out if fetch_grads else t)
                + t_param
                + (t_grad if fetch_grads else 0.0)
                + (act_in[j] if j < transfer_layers else 0.0)
            )
            ready[j] = q_in
    return max(t, q_out), stall
