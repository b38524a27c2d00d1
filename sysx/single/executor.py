"""The sliding-window executor (AdaWS §3.1 and appendix A, algorithms 1 and 2).

:class:`SlidingWindowExecutor` runs a step as ``rounds`` rounds, each pushing ``chunks`` chunks through
every layer: the forward loads blocks into the weight ring and sends activations home, the Head turns
around, the backward fetches weights, gradients and activations back, recomputes, sends gradients
home and, in the last round, hands each block to the CPU optimizer. Three streams (compute, inbound,
outbound) are ordered through the rings' per-slot events; on CPU they are no-ops, so CI runs it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from sysx import device as dev
from sysx.memory.pinned import HostBuffers
from sysx.model.attention import KVCache
from sysx.model.flat import FlatLayout
from sysx.model.layers import Block, Embedding, Head
from sysx.model.llama import tie_embeddings
from sysx.schedule.ops import Op, OpKind
from sysx.single.act_capture import (
    KeptGraph,
    ReplayStats,
    SlotLayout,
    backward_kept,
    backward_replayed,
    kept_graph_layout,
    run_captured,
    run_keeping_graph,
)
from sysx.single.host import HostState
from sysx.single.op_profile import LayerProfile
from sysx.single.plan_report import SinglePlan
from sysx.single.rings import DeviceArena, Ring, alias, align, typed
from sysx.trace.recorder import COMPUTE, D2H, H2D, Recorder, What

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TransferStats:
    """Bytes moved and work done by the executor (cumulative)."""

    h2d_weights: int = 0
    h2d_grads: int = 0
    h2d_acts: int = 0
    d2h_grads: int = 0
    d2h_acts: int = 0
    weight_loads: int = 0
    weight_reuses: int = 0  # weight slots found still valid (no load)
    chunks_backward: int = 0
    by_level: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """Plain fields."""
        return dict(self.__dict__)


class SlidingWindowExecutor:
    """Runs training steps of ``plan`` on ``device`` with the state in ``host`` (see docs/architecture.mdstring)."""

    STATIC = -1  # group id of the Embedding+Head in callbacks (host.groups[-1])

    def __init__(
        self,
        plan: SinglePlan,
        host: HostState,
        device: torch.device | str,
        profile: LayerProfile,
        *,
        trace: bool = False,
    ) -> None:
        self.plan = plan
        self.host = host
        self.device = torch.device(device)
        cfg = plan.request.model
        self.cfg = cfg
        self.L = cfg.n_layers
        self.n = plan.chunks
        self.b = plan.chunk
        self.S = plan.request.seq_len
        self.C, self.J, self.units = plan.seq_chunk, plan.seq_chunks, plan.units
        self.dtype = plan.request.dtype
        self.profile = profile
        self.keep_graph = plan.keep_graph
        self.layouts = _slot_layouts(plan, profile)
        self._graphs: dict[tuple[int, int], KeptGraph] = {}  # (block, unit) -> its forward, until its backward
        self.n_transfer = plan.transfer_layers
        R_p, R_g, R_a = plan.r_param, plan.r_grad, plan.r_act
        if R_a % self.units:
            raise ValueError(f"R_act={R_a} must be a multiple of units per round ({self.units})")
        # the host layouts describe the fp32 masters; the device holds the same entries in the compute dtype
        self.block_layout = FlatLayout(host.groups[0].layout.entries, self.dtype)
        self.static_layout = FlatLayout(host.static.layout.entries, self.dtype)
        tau = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = self.block_layout.numel * tau
        slot_bytes = max(layout.nbytes for layout in self.layouts)
        self.arena = DeviceArena(
            self.device,
            {
                "static weights": self.static_layout.numel * tau,
                "static grads": self.static_layout.numel * tau,
                "weight ring": R_p * _stride(block_bytes),
                "grad ring": R_g * _stride(block_bytes),
                "activation ring": R_a * _stride(slot_bytes),
                "transitions": self.n * self.b * self.S * cfg.dim * tau,
                **self._kv_regions(tau),
            },
        )
        self.trace: list[tuple[str, str, int, object]] | None = [] if trace else None
        self.ring_w = Ring("weights", self.arena.region("weight ring"), R_p, block_bytes, log=self.trace)
        self.ring_g = Ring("grads", self.arena.region("grad ring"), R_g, block_bytes, log=self.trace)
        self.ring_a = Ring("activations", self.arena.region("activation ring"), R_a, slot_bytes, log=self.trace)
        self.T = typed(self.arena.region("transitions"), self.dtype).view(self.n, self.b, self.S, cfg.dim)
        self.kv = self._kv_cache()
        self.static_w = typed(self.arena.region("static weights"), self.dtype)
        self.static_g = typed(self.arena.region("static grads"), self.dtype)

        self.shells, self.emb, self.head = self._compute_modules()

        self.host_buffers = HostBuffers("saved activations", pin=dev.is_cuda(self.device))
        self.host_acts = {
            (k, v): self.host_buffers.empty(self.layouts[k].nbytes, torch.uint8)
            for k in range(self.n_transfer)
            for v in range(self.units)
        }
        self.compute = dev.current_stream(self.device)
        self.inbound = dev.new_stream(self.device)
        self.outbound = dev.new_stream(self.device)
        self.stats = TransferStats()
        self.replay = ReplayStats()
        self.version = 0
        self._act_home: dict[tuple[int, int], dev.Event] = {}
        self._static_home: dev.Event | None = None
        self._grad_home: dict[int, dev.Event] = {}
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)

    def _compute_modules(self) -> tuple[list[Block], Embedding, Head]:
        """One Block shell per weight slot, its parameters views of that slot, and the Embedding and
        Head bound to the static weights and gradients."""
        cfg = self.cfg
        shells = []
        for s in range(len(self.ring_w)):
            shell = Block(cfg, device="cpu", dtype=self.dtype)
            self.block_layout.bind([shell], typed(self.ring_w.raw(s), self.dtype, self.block_layout.numel))
            shells.append(shell)
        emb = Embedding(cfg, device="cpu", dtype=self.dtype)
        head = Head(cfg, device="cpu", dtype=self.dtype)
        if cfg.tie_embeddings:
            tie_embeddings(emb, head)
        self.static_layout.bind([emb, head], self.static_w)
        self.static_layout.bind_grads([emb, head], self.static_g)
        return shells, emb, head

    # ------------------------------------------------------------------------------- recording
    def _recording(self) -> Recorder | None:
        rec = self.recorder
        return rec if rec is not None and rec.on else None

    @contextlib.contextmanager
    def _on(self, stream: dev.Stream, lane: str, what: What, nbytes: int = 0) -> Iterator[None]:
        """``with stream.use()``; when recording, the block is framed by two events on ``stream``
        (after the waits issued on it before)."""
        rec = self._recording()
        with stream.use():
            begin = rec.mark(stream) if rec is not None else None
            yield
            if rec is not None and begin is not None:
                rec.add(lane, what, begin, rec.mark(stream), nbytes)

    def _timed(
        self, stream: dev.Stream, lane: str, what: What, write: Callable[[torch.Tensor], object], nbytes: int = 0
    ) -> Callable[[torch.Tensor], object]:
        """``write`` for :meth:`Ring.fill`, framed like :meth:`_on` when recording (the ring runs it
        on ``stream`` after the slot's wait)."""
        rec = self._recording()
        if rec is None:
            return write

        def timed(raw: torch.Tensor) -> None:
            begin = rec.mark(stream)
            write(raw)
            rec.add(lane, what, begin, rec.mark(stream), nbytes)

        return timed

    # ---------------------------------------------------------------------------- sequence chunks
    def _kv_regions(self, tau: int) -> dict[str, int]:
        """Arena bytes of the K/V cache (compute dtype) and its fp32 gradients; none without sequence chunks."""
        if self.J == 1:
            return {}
        n = self.b * self.cfg.n_kv_heads * self.S * self.cfg.head_dim
        return {"K/V cache": 2 * n * tau, "K/V grads": 2 * n * 4}

    def _kv_cache(self) -> KVCache | None:
        if self.J == 1:
            return None
        shape = (self.b, self.cfg.n_kv_heads, self.S, self.cfg.head_dim)
        kv = typed(self.arena.region("K/V cache"), self.dtype).view(2, *shape)
        grads = typed(self.arena.region("K/V grads"), torch.float32).view(2, *shape)
        return KVCache(alias(kv[0]), alias(kv[1]), 0, alias(grads[0]), alias(grads[1]))

    def _piece(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Sequence chunk ``j`` of ``x [rows, S, ...]`` (all of it without sequence chunks)."""
        return x if self.J == 1 else x[:, j * self.C : (j + 1) * self.C]

    def _kv_at(self, j: int) -> KVCache | None:
        return None if self.kv is None else self.kv.at(j * self.C)

    # ------------------------------------------------------------------------------------ info
    def _note(self, op: str, key: object) -> None:
        if self.trace is not None:
            self.trace.append(("executor", op, -1, key))

    def idle_between_steps(self) -> torch.Tensor:
        """Device bytes no one reads between a step's end and the next forward: the activation ring
        (the backward consumed every saved activation), lent to the optimizer's device lane."""
        return self.arena.region("activation ring")

    def device_bytes(self) -> dict[str, int]:
        """Bytes of every arena region (the whole preallocated working set)."""
        return self.arena.describe()

    # ------------------------------------------------------------------------------------- step
    def run_step(
        self,
        batches: Sequence[Batch],
        *,
        scale: float,
        on_grads: Callable[[int, dev.Event], None],
        before_load: Callable[[int], None],
        divisors: Sequence[float] | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward of every round of one step; returns each micro-batch's loss.

        ``batches``: ``rounds * chunks`` (input_ids, labels) pairs on the device, in micro-batch
        order; micro-batch ``i``'s loss counts ``1 / divisors[i]`` of the step's gradient (None: each
        ``1 / len(batches)``, :mod:`sysx.data.loss_weights`). ``on_grads(group, event)`` is called once per group when its final gradients are on
        their way home (``event`` completes when they are in ``host.groups[group].grad``; the
        Embedding+Head group is ``-1``). ``before_load(group)`` must block until the group's host
        weights are current (its optimizer step finished).
        """
        n_micro = len(batches)
        if n_micro != self.plan.rounds * self.n:
            raise ValueError(
                f"run_step: got {n_micro} micro-batches, the plan has {self.plan.rounds} rounds x {self.n} chunks"
            )
        self.version += 1
        ver = self.version
        self._graphs.clear()  # a step cut short by an error left its forwards behind
        self._load_static(before_load)
        if self._static_home is not None:  # the last step's embedding/head gradients must have left
            self.compute.wait_event(self._static_home)
        with self.compute.use():
            self.static_g.zero_()
        self._grad_home.clear()
        losses: list[torch.Tensor] = []
        rounds = self.plan.rounds
        divisors = [float(n_micro)] * n_micro if divisors is None else list(divisors)
        for r in range(rounds):
            mbs = batches[r * self.n : (r + 1) * self.n]
            last = r == rounds - 1
            self._forward(r, ver, mbs, before_load)
            losses += self._turnaround(mbs, scale, divisors[r * self.n : (r + 1) * self.n])
            self._backward(r, ver, mbs, on_grads if last else None, before_load, last)
        self.outbound.wait_event(self.compute.record_event())
        nbytes = self.static_g.numel() * self.static_g.element_size()
        with self._on(self.outbound, D2H, Op(OpKind.OFFLOAD_GRADS, 0, 0), nbytes):
            self.host.static.grad.copy_(self.static_g, non_blocking=True)
        self.stats.d2h_grads += nbytes
        self._static_home = self.outbound.record_event(blocking=True)  # an optimizer thread waits on it
        on_grads(self.STATIC, self._static_home)
        return losses

    def _load_static(self, before_load: Callable[[int], None]) -> None:
        """Copy the Embedding+Head weights in, after their optimizer step and after the last use of the buffer."""
        before_load(self.STATIC)
        self.inbound.wait_stream(self.compute)
        nbytes = self.static_w.numel() * self.static_w.element_size()
        with self._on(self.inbound, H2D, Op(OpKind.LOAD_PARAMS, 0), nbytes):
            self.static_w.copy_(self.host.static.work, non_blocking=True)
        self.compute.wait_event(self.inbound.record_event())
        self.stats.h2d_weights += nbytes

    # ------------------------------------------------------------------------------- transfers
    def _ensure_w(self, k: int, ver: int, before_load: Callable[[int], None]) -> None:
        """Make weight slot ``k % R_param`` hold block ``k`` of this step (load it unless it still does)."""
        s = k % len(self.ring_w)
        key = ("w", k, ver)
        if self.ring_w.key(s) == key and self.ring_w.state(s) == "ready":
            self.stats.weight_reuses += 1
            return
        if self.ring_w.state(s) == "ready":
            self.ring_w.drop(s)
        before_load(k)
        src = self.host.groups[k].work
        self.ring_w.fill(
            s,
            key,
            self.inbound,
            self._timed(
                self.inbound,
                H2D,
                Op(OpKind.LOAD_PARAMS, k + 1),
                lambda raw: typed(raw, self.dtype, self.block_layout.numel).copy_(src, non_blocking=True),
                src.numel() * src.element_size(),
            ),
        )
        self.stats.h2d_weights += src.numel() * src.element_size()
        self.stats.weight_loads += 1

    def _fill_g(self, k: int, r: int) -> None:
        """Gradient slot for block ``k`` in round ``r``: zeros first, then the host's accumulated gradients."""
        gs = k % len(self.ring_g)
        numel = self.block_layout.numel
        if r == 0:
            self.ring_g.fill(gs, ("g", k, r), self.inbound, lambda raw: typed(raw, self.dtype, numel).zero_())
            return
        self.inbound.wait_event(self._grad_home[k])
        src = self.host.groups[k].grad
        self.ring_g.fill(
            gs,
            ("g", k, r),
            self.inbound,
            self._timed(
                self.inbound,
                H2D,
                f"H2D grads s{k + 1}",
                lambda raw: typed(raw, self.dtype, numel).copy_(src, non_blocking=True),
                src.numel() * src.element_size(),
            ),
        )
        self.stats.h2d_grads += src.numel() * src.element_size()

    def _fill_a(self, a: int, unit: int, r: int) -> None:
        """Fetch the saved activations of ``unit`` (a transferring block) from host into activation slot ``a``."""
        k, v = divmod(unit, self.units)
        if k >= self.n_transfer:
            raise AssertionError(f"unit {unit} (block {k}) never went home; it cannot be fetched")
        nbytes = self.layouts[k].nbytes
        self.inbound.wait_event(self._act_home[(k, v)])
        src = self.host_acts[(k, v)]
        label = f"H2D act s{k + 1} mb{v // self.J}" + (f" seq{v % self.J}" if self.J > 1 else "")
        self.ring_a.fill(
            a,
            ("a", k, v, r),
            self.inbound,
            self._timed(self.inbound, H2D, label, lambda raw: raw[:nbytes].copy_(src, non_blocking=True), nbytes),
        )
        self.stats.h2d_acts += nbytes

    # ---------------------------------------------------------------------------------- forward
    def _forward(self, r: int, ver: int, mbs: Sequence[Batch], before_load: Callable[[int], None]) -> None:
        L = self.L
        R_p, R_a = len(self.ring_w), len(self.ring_a)
        for k in range(min(R_p, L)):
            self._ensure_w(k, ver, before_load)
        with self._on(self.compute, COMPUTE, Op(OpKind.FORWARD, 0)), torch.no_grad():
            for c, (ids, _) in enumerate(mbs):
                self.T[c].copy_(self.emb(ids))
        for k in range(L):
            s = k % R_p
            self.ring_w.acquire(s, ("w", k, ver), self.compute)
            shell, layout = self.shells[s], self.layouts[k]
            for v in range(self.units):  # unit v: chunk v // J, its sequence chunk v % J (in sequence order)
                c, j = divmod(v, self.J)
                a = (k * self.units + v) % R_a
                key = ("a", k, v, r)

                def write(
                    raw: torch.Tensor,
                    c: int = c,
                    j: int = j,
                    v: int = v,
                    k: int = k,
                    shell: Block = shell,
                    layout: SlotLayout = layout,
                ) -> None:
                    x = self._piece(self.T[c], j)
                    if self.keep_graph:
                        self._graphs[(k, v)] = run_keeping_graph(shell, x, layout, raw, out=x)
                    else:
                        x.copy_(run_captured(shell, x, self.profile, layout, raw, kv=self._kv_at(j)))

                self.ring_a.fill(
                    a, key, self.compute, self._timed(self.compute, COMPUTE, Op(OpKind.FORWARD, k + 1, mb=c), write)
                )
                if k < self.n_transfer:
                    raw = self.ring_a.acquire(a, key, self.outbound)
                    with self._on(
                        self.outbound,
                        D2H,
                        f"D2H act s{k + 1} mb{c}" + (f" seq{j}" if self.J > 1 else ""),
                        layout.nbytes,
                    ):
                        self.host_acts[(k, v)].copy_(raw[: layout.nbytes], non_blocking=True)
                    self._act_home[(k, v)] = self.ring_a.release(a, self.outbound)
                    self.stats.d2h_acts += layout.nbytes
                    self._note("d2h_act", key)
            self.ring_w.release(s, self.compute, keep=k >= L - R_p)
            if k + R_p < L:
                self._ensure_w(k + R_p, ver, before_load)
            elif k + R_p == L:  # no weights left to prefetch: fill the gradient ring for backward (alg. 1)
                for j in range(L - 1, max(-1, L - 1 - len(self.ring_g)), -1):
                    self._fill_g(j, r)

    def _turnaround(self, mbs: Sequence[Batch], scale: float, divisors: Sequence[float]) -> list[torch.Tensor]:
        """Head forward + backward per chunk (``backward(loss / divisor * scale)``); T becomes the gradient."""
        losses = []
        with self._on(self.compute, COMPUTE, Op(OpKind.BACKWARD, self.L + 1, 0)):
            for c, (_, labels) in enumerate(mbs):
                x = self.T[c].detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = self.head(x, labels)
                    scaled = loss / divisors[c]
                    if scale != 1.0:
                        scaled = scaled * scale
                    scaled.backward()
                losses.append(loss.detach().float())
                assert x.grad is not None
                self.T[c].copy_(x.grad)
        return losses

    # --------------------------------------------------------------------------------- backward
    def _backward_chunk(self, k: int, c: int, r: int, shell: Block, layout: SlotLayout) -> None:
        """Backward of block ``k`` on chunk ``c``: its units (sequence chunks) in reverse order, after
        rebuilding the K/V cache from their saved inputs when the sequences are chunked."""
        R_a = len(self.ring_a)
        first = k * self.units + c * self.J
        if self.kv is not None:
            with self._on(self.compute, COMPUTE, f"K/V rebuild s{k + 1} mb{c}"):
                for j in range(self.J):  # the slots stay ready for the backward below
                    u = first + j
                    raw = self.ring_a.acquire(u % R_a, ("a", k, u - k * self.units, r), self.compute)
                    shell.cache_keys_values(layout.view(raw, layout.input), self.kv.at(j * self.C))
                    self.ring_a.release(u % R_a, self.compute, keep=True)
                self.kv.zero_grads()
        for j in range(self.J - 1, -1, -1):
            u = first + j
            a = u % R_a
            raw = self.ring_a.acquire(a, ("a", k, u - k * self.units, r), self.compute)
            with self._on(self.compute, COMPUTE, Op(OpKind.BACKWARD, k + 1, 0, c)):
                grad = self._piece(self.T[c], j)
                if self.keep_graph:  # every site reused, none recomputed
                    gx = backward_kept(self._graphs.pop((k, u - k * self.units)), grad)
                    self.replay.reused_sites += len(self.profile.sites)
                    self.replay.reused_flops += self.profile.flops()
                else:
                    gx = backward_replayed(shell, grad, self.profile, layout, raw, stats=self.replay, kv=self._kv_at(j))
                grad.copy_(gx)
            self.ring_a.release(a, self.compute)
            self.stats.chunks_backward += 1
            name = self.plan.table.names[self.plan.levels[k]]
            self.stats.by_level[name] = self.stats.by_level.get(name, 0) + 1
            if u - R_a >= 0:
                self._fill_a(a, u - R_a, r)

    def _backward(
        self,
        r: int,
        ver: int,
        mbs: Sequence[Batch],
        on_grads: Callable[[int, dev.Event], None] | None,
        before_load: Callable[[int], None],
        last: bool,
    ) -> None:
        L = self.L
        R_p, R_g = len(self.ring_w), len(self.ring_g)
        numel = self.block_layout.numel
        for k in range(L - 1, -1, -1):
            s, gs = k % R_p, k % R_g
            self.ring_w.acquire(s, ("w", k, ver), self.compute)
            graw = self.ring_g.acquire(gs, ("g", k, r), self.compute)
            shell, layout = self.shells[s], self.layouts[k]
            self.block_layout.bind_grads([shell], typed(graw, self.dtype, numel))
            for c in range(self.n):
                self._backward_chunk(k, c, r, shell, layout)
            self.ring_w.release(s, self.compute, keep=not last and k < R_p)
            if k - R_p >= 0:
                self._ensure_w(k - R_p, ver, before_load)
            # gradients home; the slot is free again once the copy finished
            self.outbound.wait_event(self.compute.record_event())
            dst = self.host.groups[k].grad
            with self._on(self.outbound, D2H, Op(OpKind.OFFLOAD_GRADS, k + 1, 0), dst.numel() * dst.element_size()):
                dst.copy_(typed(graw, self.dtype, numel), non_blocking=True)
            self.stats.d2h_grads += dst.numel() * dst.element_size()
            self._note("d2h_grad", ("g", k, r))
            event = self.ring_g.release(gs, self.outbound)
            self._grad_home[k] = event
            if on_grads is not None:
                on_grads(k, event)
                self._note("optimizer", ("g", k, r))
            if k - R_g >= 0:
                self._fill_g(k - R_g, r)
        with self._on(self.compute, COMPUTE, Op(OpKind.BACKWARD, 0, 0)), torch.enable_grad():
            for c, (ids, _) in enumerate(mbs):
                self.emb(ids).backward(self.T[c])

    # ------------------------------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self, pieces: Sequence[Batch], before_load: Callable[[int], None]) -> list[torch.Tensor]:
        """Mean loss of each (input_ids, labels) piece of at most ``chunk`` rows (forward only, nothing saved)."""
        if any(ids.shape[0] > self.b or ids.shape[1] != self.S for ids, _ in pieces):
            raise ValueError(f"evaluate: pieces must have at most {self.b} rows of {self.S} tokens")
        self.version += 1
        ver = self.version
        self._load_static(before_load)
        out: list[torch.Tensor] = []
        R_p = len(self.ring_w)
        for start in range(0, len(pieces), self.n):
            group = pieces[start : start + self.n]
            views = [self.T[c][: ids.shape[0]] for c, (ids, _) in enumerate(group)]
            for k in range(min(R_p, self.L)):
                self._ensure_w(k, ver, before_load)
            with self.compute.use():
                for view, (ids, _) in zip(views, group):
                    view.copy_(self.emb(ids))
            for k in range(self.L):
                s = k % R_p
                self.ring_w.acquire(s, ("w", k, ver), self.compute)
                with self.compute.use():
                    for view in views:
                        for j in range(self.J):  # sequence chunks in order: each sees the K/V of those before
                            piece = self._piece(view, j)
                            piece.copy_(self.shells[s](piece, self._kv_at(j)))
                self.ring_w.release(s, self.compute, keep=k >= self.L - R_p)
                if k + R_p < self.L:
                    self._ensure_w(k + R_p, ver, before_load)
            with self.compute.use():
                out += [self.head(view, labels).float() for view, (_, labels) in zip(views, group)]
        for s in range(R_p):
            if self.ring_w.state(s) == "ready":
                self.ring_w.drop(s)
        return out

    def close(self) -> None:
        """Free the host buffers of the saved activations and any kept graph."""
        self._graphs.clear()
        self.host_acts.clear()
        self.host_buffers.close()


def _slot_layouts(plan: SinglePlan, profile: LayerProfile) -> list[SlotLayout]:
    """Each block's activation slot: its save level's, or with kept graphs its input and what its
    graph saves (a plan keeps them only when every block stays and sequences are whole)."""
    L = plan.sizes.n_blocks
    if not plan.keep_graph:
        return [plan.table.layouts[o] for o in plan.levels]
    if plan.window < L or plan.seq_chunks > 1:
        raise ValueError(
            f"a plan that keeps graphs needs every block on the device and whole sequences; this one has "
            f"W={plan.window} of {L} blocks and {plan.seq_chunks} sequence chunks"
        )
    return [kept_graph_layout(profile)] * L


def _stride(nbytes: int) -> int:
    return align(nbytes)
