"""What each activation save level costs a block: slot bytes, recompute avoided, workspace
(:class:`LevelTable`, from a layer profile and the hardware), and the predicted step time of a
window (:func:`predict_step`, :func:`simulate_round`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sysx.model.config import ModelConfig
from sysx.single.act_policy import LEVEL_NAMES, N_LEVELS, pyao_recompute_mask
from sysx.single.hardware import HardwareProfile
from sysx.single.plan_request import ModelSizes, PlanRequest
from sysx.single.sites import LayerProfile, Profiler, SlotLayout, profile_layer

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


def predict_step(req: PlanRequest, sizes: ModelSizes, hw: HardwareProfile, table: LevelTable, W: int, chunks: int,
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
                     "chosen": req.policy not in ("dp",) and o == req.top_option})
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
