"""The one interpreter of a rank's op list: a dispatch table from :class:`OpKind` to a handler.

Every schedule (gpipe, 1f1b, interleaved_1f1b, mobius, sysx and its ablations) and the forward-only
evaluation program (:func:`sysx.schedule.evaluation_schedule`) run through :meth:`Executor.run`,
with the op semantics of :mod:`sysx.schedule.ops`. A failure is re-raised as
:class:`ExecutionError`, naming the rank, the step and the op and showing the ops around it (a
peer timeout or a transfer mismatch passes unchanged: it already names them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sysx import device as dev
from sysx import trace
from sysx.data.loss_weights import LossWeights
from sysx.dist import PeerTimeout
from sysx.emulate.pacer import Pacer
from sysx.model import FlatLayout, ModelConfig, run_layers
from sysx.model.llama import make_shell
from sysx.model.loss import IGNORE_INDEX
from sysx.partition import unit_label
from sysx.runtime.buffers import GradBuffers, ParamPool, load_places
from sysx.runtime.optimizer import RankOptimizer
from sysx.runtime.p2p import P2P, Pending, TransferMismatch, TransferSpec
from sysx.runtime.stage_params import StageParams
from sysx.schedule import Message, Op, OpKind, Schedule
from sysx.schedule.ops import format_op_window

BatchFn = Callable[[int, int, str], tuple[torch.Tensor, torch.Tensor]]


class ExecutionError(RuntimeError):
    """An op failed; the first line names the rank, the step, the op index and the op, the next
    ones show the ops around it in the rank's list."""


@dataclass
class StepContext:
    """What one run of an op list is about."""

    step: int
    lr: float = 0.0
    scale: float = 1.0
    n_micro: int = 1
    replicas: int = 1  # data-parallel replicas: a loss counts 1 / (n_micro x replicas) of the step's gradient
    # how the losses add up when the data has a loss mask (sysx.data.loss_weights); None: as ``replicas`` says
    weights: LossWeights | None = None
    split: str = "train"
    training: bool = True
    losses: list[torch.Tensor] = field(default_factory=list)
    loss_weights: list[float] = field(default_factory=list)  # the weight of each of ``losses``
    op_seconds: dict[str, float] = field(default_factory=dict)
    # host ``time.monotonic()`` (one clock for every process of a node) when this rank's last
    # BACKWARD and its VALIDATE returned: the optimizer time left exposed lies between them
    backward_end: float = 0.0
    validate_end: float = 0.0

    def divisor(self, weight: float) -> float:
        """What a micro-batch's mean loss of ``weight`` is divided by for the step's gradient."""
        return self.n_micro * self.replicas if self.weights is None else self.weights.divisor(weight)

    def loss_sums(self) -> list[float]:
        """This rank's share of the step's loss: ``[sum of weight x loss, sum of weights]``."""
        if self.weights is None or not self.weights.per_token:  # every loss weighs 1: the plain sum, as ever
            return [float(torch.stack(self.losses).sum()) if self.losses else 0.0, float(len(self.losses))]
        return [sum(float(v) * w for v, w in zip(self.losses, self.loss_weights)), sum(self.loss_weights)]


def _part_rows(parts: int, micro_batch_size: int, rank: int) -> int:
    """Rows of a micro-batch each of its ``parts`` backward parts runs, or an error naming the fix."""
    if micro_batch_size % parts:
        raise ExecutionError(
            f"rank {rank}: schedule.backward_parts={parts} must divide train.micro_batch_size="
            f"{micro_batch_size} (each part is rows of the micro-batch); use a divisor or null"
        )
    return micro_batch_size // parts


class Executor:
    """Runs one rank's ops (see docs/architecture.md)."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        *,
        model_cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        micro_batch_size: int,
        seq_len: int,
        params: StageParams,
        pool: ParamPool,
        grads: GradBuffers,
        optimizer: RankOptimizer,
        p2p: P2P | None,
        batch: BatchFn,
        pacer: Pacer | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.model_cfg = model_cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.params = params
        self.pool = pool
        # each op list's places in the pool, planned the first time it runs (keyed by identity;
        # the list is kept so its id is not reused): {id: (ops, {LOAD op index: offset})}
        self._places: dict[int, tuple[Sequence[Op], dict[int, int]]] = {}
        self._at: dict[int, int] = {}
        self.grads = grads
        self.optimizer = optimizer
        self.p2p = p2p
        self.batch_fn = batch
        self.head_layer = model_cfg.n_layers + 1
        self.last_stage = schedule.n_stages - 1
        self.act_shape = (micro_batch_size, seq_len, model_cfg.dim)
        self.ids_shape = (micro_batch_size, seq_len)
        # schedule.backward_parts: a backward part runs rows [p * part_rows, (p + 1) * part_rows) of its micro-batch
        self.parts = schedule.options.backward_parts
        self.part_rows = _part_rows(self.parts, micro_batch_size, rank)
        self.handlers: dict[OpKind, Callable[[Op], None]] = {
            OpKind.LOAD_PARAMS: self._load,
            OpKind.FREE: self._free,
            OpKind.FORWARD: self._forward,
            OpKind.BACKWARD: self._backward,
            OpKind.SEND_ACT: self._send_act,
            OpKind.RECV_ACT: self._recv_act,
            OpKind.SEND_GRAD: self._send_grad,
            OpKind.RECV_GRAD: self._recv_grad,
            OpKind.SEND_CKPT: self._send_ckpt,
            OpKind.RECV_CKPT: self._recv_ckpt,
            OpKind.WAIT_ACT: self._wait,
            OpKind.WAIT_GRAD: self._wait,
            OpKind.WAIT_CKPT: self._wait,
            OpKind.OFFLOAD_GRADS: self._offload,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.VALIDATE: self._validate,
        }
        # an emulated device paces the handlers to its modelled durations; a real one keeps them
        self.pacer = pacer or Pacer()
        self.handlers = self.pacer.wrap(self.handlers, lambda unit: self.optimizer.events.get(unit))
        self._modules: dict[tuple[int, int], tuple[list[nn.Module], FlatLayout]] = {}
        self._bindings: dict[tuple[int, int], tuple[torch.device, int, int]] = {}  # layers -> slot region bound
        self._batches: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor, float, list[float]]] = {}
        self.acts: dict[tuple[int, int], torch.Tensor] = {}
        self.ckpts: dict[tuple[int, int, int], torch.Tensor] = {}
        # keep_activations: a forward's input (leaf) and output, its autograd graph, until the backward
        self.kept: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.igrads: dict[tuple[int, int, int], torch.Tensor] = {}
        self.inflight: dict[tuple[Message, int, int, int], Pending] = {}  # posted receives, by message
        self.sends: list[Pending] = []
        self.ctx = StepContext(step=-1)
        self._ops: Sequence[Op] = ()
        self._index = -1
        self._op: Op | None = None
        self.recorder: trace.Recorder | None = None  # set for a window of recorded steps (sysx.trace)

    # ------------------------------------------------------------------------------------ loop
    def run(self, ops: Sequence[Op], ctx: StepContext) -> StepContext:
        """Execute ``ops`` in order; returns ``ctx`` with the losses this rank computed."""
        self.ctx = ctx
        self._ops = ops
        self._at = self._load_places(ops)
        self._batches.clear()
        tracing = trace.enabled()
        rec = self.recorder
        timer = dev.OpTimer(self.device)  # device time per op kind, not host enqueue time
        for index, op in enumerate(ops):
            handler = self.handlers.get(op.kind)
            self._index, self._op = index, op
            if handler is None:
                raise self._error(
                    f"{self._label}: no handler for op kind {op.kind!r} in the executor's dispatch table "
                    f"(known: {', '.join(k.name for k in self.handlers)})"
                )
            started = timer.start()
            try:
                if rec is not None and rec.on:
                    self._run_recorded(rec, op, handler, tracing)
                elif tracing:
                    with trace.nvtx_range(op.trace_name()):
                        handler(op)
                else:
                    handler(op)
            except (ExecutionError, PeerTimeout, TransferMismatch):
                raise  # they already name the rank, the op and the peer
            except Exception as err:
                raise self._error(
                    f"{self._label} of schedule {self.schedule.name!r} failed: {type(err).__name__}: {err}"
                ) from err
            timer.stop(op.kind.name, started)
            if op.kind == OpKind.BACKWARD:
                ctx.backward_end = time.monotonic()
            elif op.kind == OpKind.VALIDATE:
                ctx.validate_end = time.monotonic()
            if self.sends:
                self._reap_sends()
        for kind, seconds in timer.seconds().items():
            ctx.op_seconds[kind] = ctx.op_seconds.get(kind, 0.0) + seconds
        return ctx

    def _run_recorded(self, rec: trace.Recorder, op: Op, handler: Callable[[Op], None], tracing: bool) -> None:
        """Run ``op`` under the recorder: copies and messages it starts are recorded under it by
        the buffers and p2p; an op of the compute lane is framed by two compute-stream events."""
        rec.op = op
        if trace.op_lane(op) != trace.COMPUTE:
            with trace.nvtx_range(op.trace_name()) if tracing else contextlib.nullcontext():
                handler(op)
            return
        if op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
            # the pass's wait for its parameters' copy goes before the start mark, so the span is
            # the pass (the handler waits again, which is free)
            self.pool.view(self.schedule.layers(op), str(op))
        begin = rec.mark()
        with trace.nvtx_range(op.trace_name()) if tracing else contextlib.nullcontext():
            handler(op)
        rec.add(trace.COMPUTE, op, begin, rec.mark())

    @property
    def _op_name(self) -> str:
        return str(self._op)

    @property
    def _where(self) -> str:
        """``step 3: op #12 `B s1.0 mb0``` (built only when a message needs it)."""
        return f"step {self.ctx.step}: op #{self._index} `{self._op}`"

    @property
    def _label(self) -> str:
        return f"rank {self.rank}: {self._where}"

    def _error(self, message: str) -> ExecutionError:
        """``message`` followed by the ops around the current one in the list being run."""
        context = format_op_window(self._ops, self._index)
        return ExecutionError(
            f"{message}\n  rank {self.rank}'s ops around op #{self._index} (of {len(self._ops)}):\n{context}"
        )

    def leftovers(self) -> list[str]:
        """Tensors still held between ops (empty after a complete op list)."""
        out = [f"act {unit_label(s)} mb{j}" for s, j in self.acts]
        out += [f"checkpoint {unit_label(s, k)} mb{j}" for s, k, j in self.ckpts]
        out += [f"kept activations of {unit_label(s, k)} mb{j}" for s, k, j in self.kept]
        out += [f"input gradient {unit_label(s, k)} mb{j}" for s, k, j in self.igrads]
        out += [f"posted receive of {m.noun} {unit_label(s, k)} mb{j}" for m, s, k, j in self.inflight]
        out += [f"gradients of {unit_label(s, k)} not offloaded" for s, k in self.grads.active]
        return out

    def reset(self) -> None:
        """Drop every tensor held between ops (after an error, or before closing)."""
        self.acts.clear()
        self.ckpts.clear()
        self.kept.clear()
        self.igrads.clear()
        self.inflight.clear()
        self.sends.clear()
        self.grads.active.clear()
        self.pool.clear()  # the next op list starts from an empty pool, as its plan does
        self._batches.clear()

    def close(self) -> None:
        """Drop every tensor and module shell the executor holds (idempotent)."""
        self.reset()
        self._modules.clear()
        self._bindings.clear()

    # --------------------------------------------------------------------------------- helpers
    def _batch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor, float, list[float]]:
        """Micro-batch ``mb``'s ids and labels on the device, its loss weight, and each backward part's
        share of its trained tokens (all from the host labels)."""
        key = (self.ctx.step, self.ctx.split, mb)
        if key not in self._batches:
            ids, labels = self.batch_fn(self.ctx.step, mb, self.ctx.split)
            weight = 1.0 if self.ctx.weights is None else self.ctx.weights.weight(labels)
            shares = [1.0]
            if self.parts > 1:  # a part's mean loss counts its tokens' share of the micro-batch's mean
                trained = (labels != IGNORE_INDEX).reshape(self.parts, -1).sum(1).tolist()
                shares = [n / max(1, sum(trained)) for n in trained]
            self._batches[key] = (
                ids.to(self.device, non_blocking=True),
                labels.to(self.device, non_blocking=True),
                weight,
                shares,
            )
        return self._batches[key]

    def _rows(self, part: int) -> slice:
        """The rows of a micro-batch that backward part ``part`` runs."""
        return slice(part * self.part_rows, (part + 1) * self.part_rows)

    def _layers_modules(self, layers: range) -> tuple[list[nn.Module], FlatLayout]:
        """Compute modules for ``layers``: storage-less shells (the weights live in the parameter pool)."""
        key = (layers.start, layers.stop)
        if key not in self._modules:
            mods = [make_shell(self.model_cfg, i, dtype=self.dtype) for i in layers]
            self._modules[key] = (mods, FlatLayout.from_modules(mods))
        return self._modules[key]

    def _bound(self, layers: range) -> tuple[list[nn.Module], FlatLayout]:
        """The modules of ``layers`` with their parameters viewing their unit in the pool; rebinding (one
        ``.data`` swap per parameter) only when that region differs from the last binding."""
        mods, layout = self._layers_modules(layers)
        view = self.pool.view(layers, self._op_name)  # also orders compute after the unit's copy
        key = (layers.start, layers.stop)
        where = (view.device, view.data_ptr(), view.numel())
        if self._bindings.get(key) != where:
            layout.bind(mods, view)
            self._bindings[key] = where
        return mods, layout

    def _run(
        self, mods: list[nn.Module], layers: range, x: torch.Tensor, mb: int, rows: slice = slice(None)
    ) -> torch.Tensor:
        labels = self._batch(mb)[1][rows] if self.head_layer in layers else None
        return run_layers(mods, x, labels)

    def _spec(self, kind: Message, s: int, k: int, j: int) -> TransferSpec:
        # the checkpoint of the model's first sub-stage is its input: the token ids
        if kind == Message.CKPT and self.schedule.partition.sub_layers(s, k).start == 0:
            return TransferSpec(kind, s, k, j, self.ids_shape, torch.int64)
        if kind == Message.GRAD and self.parts > 1:  # a backward part's rows
            return TransferSpec(kind, s, k, j, (self.part_rows, *self.act_shape[1:]), self.dtype)
        return TransferSpec(kind, s, k, j, self.act_shape, self.dtype)

    def _need_p2p(self) -> P2P:
        if self.p2p is None:
            raise self._error(f"{self._label}: a transfer between ranks in a single-process run")
        return self.p2p

    @staticmethod
    def _pop(store: dict, key: tuple, what: str) -> torch.Tensor:
        try:
            return store.pop(key)
        except KeyError:
            raise RuntimeError(
                f"{what} is not available on this rank (neither computed here nor received before); "
                f"the op list is inconsistent with the schedule"
            ) from None

    @classmethod
    def _get(cls, store: dict, key: tuple, what: str) -> torch.Tensor:
        """``store[key]``, kept for a later reader, or the error :meth:`_pop` gives."""
        return store[key] if key in store else cls._pop(store, key, what)

    def _reap_sends(self) -> None:
        # oldest first, up to the first still in flight: sends complete about in posting order, and
        # polling every pending send after every op cost O(ops x sends) on gloo, whose sends never
        # complete before they are waited for
        p2p, sends = self._need_p2p(), self.sends
        done = 0
        while done < len(sends) and p2p.completed(sends[done]):
            done += 1
        if done:
            del sends[:done]

    def _post_send(self, tensor: torch.Tensor, spec: TransferSpec, peer: int) -> None:
        self.sends.append(self._need_p2p().isend(tensor, spec, peer, self._where))

    def wait_sends(self) -> None:
        """Wait for every posted send (their receivers have received them once the program ran)."""
        if self.sends:
            self._need_p2p().wait_sends(self.sends, self._where)
            self.sends.clear()

    # -------------------------------------------------------------------------------- handlers
    def _load(self, op: Op) -> None:
        layers = self.schedule.layers(op)
        at = self._at[self._index]
        self.pool.load((op.stage, op.sub), layers, self.params.pieces(op.stage, op.sub), str(op), at)

    def _load_places(self, ops: Sequence[Op]) -> dict[int, int]:
        known = self._places.get(id(ops))
        if known is None or known[0] is not ops:
            places, size = load_places(self.schedule, ops, self.params.numels)
            if size > self.pool.buffer.numel():
                raise ExecutionError(
                    f"rank {self.rank}: this op list's parameters need a pool of {size} elements, the pool has "
                    f"{self.pool.buffer.numel()} (sized for the training and evaluation programs of {self.schedule.name!r})"
                )
            if len(self._places) >= 8:  # the training and evaluation programs, and a few one-off ones
                del self._places[next(iter(self._places))]
            known = self._places[id(ops)] = (ops, places)
        return known[1]

    def _free(self, op: Op) -> None:
        self.pool.free((op.stage, op.sub), str(op))

    def _forward(self, op: Op) -> None:
        s, j = op.stage, op.mb
        part = self.schedule.partition
        layers = part.stage_layers(s)
        mods, _ = self._bound(layers)
        x = self._batch(j)[0] if s == 0 else self._pop(self.acts, (s - 1, j), f"the input of {op} (act s{s - 1} mb{j})")
        if self.ctx.training and s == self.last_stage and j in self.schedule.options.head_igrad:
            # the Head's input gradient here, from the graph this forward builds; its backward sub-stage
            # (split 1: the checkpoint is this input) recomputes for the weight gradient only
            self.ckpts[(s, 0, j)] = x
            with torch.enable_grad():
                leaf = x.detach().requires_grad_(True)
                out = self._run(mods, layers, leaf, j)
                (grad,) = torch.autograd.grad(self._scaled_loss(out, j), leaf)
            for p in range(self.parts):  # each backward part of the sub-stage before gets its rows
                self.igrads[(s, 0, j * self.parts + p)] = grad[self._rows(p)] if self.parts > 1 else grad
            h = out.detach()
        elif self.ctx.training and self.schedule.options.keep_activations:
            # the graph lives until this rank's backward of the stage (d = 1), which backpropagates it
            with torch.enable_grad():
                leaf = x.detach().requires_grad_(True) if x.is_floating_point() else x
                out = self._run(mods, layers, leaf, j)
            self.kept[(s, 0, j)] = (leaf, out)
            h = out.detach()
        else:
            with torch.no_grad():
                h = x
                for k in range(part.split):
                    sub = part.sub_layers(s, k)
                    if self.ctx.training:
                        self.ckpts[(s, k, j)] = h
                    lo, hi = sub.start - layers.start, sub.stop - layers.start
                    h = self._run(mods[lo:hi], sub, h, j)
        if s == self.last_stage:
            self.ctx.losses.append(h.detach().float())
            self.ctx.loss_weights.append(self._batch(j)[2])
        else:
            self.acts[(s, j)] = h

    def _backward(self, op: Op) -> None:
        s, k, j = op.stage, op.sub, op.mb  # j: the micro-batch's index times the parts, plus the part
        w, part = divmod(j, self.parts)
        layers = self.schedule.partition.sub_layers(s, k)
        mods, layout = self._bound(layers)
        layout.bind_grads(mods, self.grads.get((s, k), layout.numel))
        kept = self.kept.pop((s, k, j), None)
        rows = self._rows(part) if self.parts > 1 else slice(None)
        if kept is None:
            what = f"the checkpoint of {op}"
            # the parts share the micro-batch's checkpoint: its last one frees it
            x0 = (
                self._pop(self.ckpts, (s, k, w), what)
                if part == self.parts - 1
                else self._get(self.ckpts, (s, k, w), what)
            )
            x0 = x0[rows]
        nxt = self.schedule.partition.next_sub(s, k)
        grad_out = (
            None
            if nxt is None
            else self._pop(self.igrads, (nxt[0], nxt[1], j), f"the output gradient of {op} (from B {unit_label(*nxt)})")
        )
        with torch.enable_grad():
            if kept is not None:  # the forward's own graph: no recompute
                x, out = kept
            else:
                # the Head's input gradient already computed by its forward: the weight gradient only
                wants_input = x0.is_floating_point() and not (nxt is None and w in self.schedule.options.head_igrad)
                x = x0.detach().requires_grad_(True) if wants_input else x0
                out = self._run(mods, layers, x, w, rows)
            if grad_out is None:
                self._scaled_loss(out, w, part).backward()
            else:
                torch.autograd.backward(out, grad_out)
        if x.requires_grad:
            if x.grad is None:
                raise RuntimeError(f"{op}: no gradient reached the sub-stage input")
            self.igrads[(s, k, j)] = x.grad

    def _scaled_loss(self, loss: torch.Tensor, j: int, part: int | None = None) -> torch.Tensor:
        """Micro-batch ``j``'s loss (or backward part ``part``'s) as its backward starts from it: over
        the step's divisor, times the loss scale; a part's mean loss weighs its share of the tokens."""
        _, _, weight, shares = self._batch(j)
        scaled = loss / self.ctx.divisor(weight)
        if part is not None and self.parts > 1:
            scaled = scaled * shares[part]
        return scaled * self.ctx.scale if self.ctx.scale != 1.0 else scaled

    def _send_act(self, op: Op) -> None:
        t = self._pop(self.acts, (op.stage, op.mb), f"act s{op.stage} mb{op.mb}")
        self._post_send(t, self._spec(Message.ACT, op.stage, -1, op.mb), op.peer)

    def _recv_act(self, op: Op) -> None:
        got = self._receive(op)
        if got is not None:
            self.acts[(op.stage, op.mb)] = got

    def _send_grad(self, op: Op) -> None:
        key = (op.stage, op.sub, op.mb)
        t = self._pop(self.igrads, key, f"input gradient {unit_label(op.stage, op.sub)} mb{op.mb}")
        self._post_send(t, self._spec(Message.GRAD, *key), op.peer)

    def _recv_grad(self, op: Op) -> None:
        got = self._receive(op)
        if got is not None:
            self.igrads[(op.stage, op.sub, op.mb)] = got

    def _send_ckpt(self, op: Op) -> None:
        key = (op.stage, op.sub, op.mb)
        t = self._pop(self.ckpts, key, f"checkpoint {unit_label(op.stage, op.sub)} mb{op.mb}")
        self._post_send(t, self._spec(Message.CKPT, *key), op.peer)  # async or not: the receive decides when

    def _recv_ckpt(self, op: Op) -> None:
        got = self._receive(op)
        if got is not None:
            self.ckpts[(op.stage, op.sub, op.mb)] = got

    def _receive(self, op: Op) -> torch.Tensor | None:
        """A blocking receive's tensor; an async one is posted (its WAIT op stores it) and gives None."""
        p2p, spec = self._need_p2p(), self._spec(*op.message)
        if op.is_async:
            self.inflight[op.message] = p2p.irecv(spec, op.peer, self._where)
            return None
        return p2p.recv(spec, op.peer, self._where)

    def _wait(self, op: Op) -> None:
        family, s, k, j = op.message
        pending = self.inflight.pop(op.message, None)
        if pending is None:
            raise RuntimeError(f"no receive of {family.noun} {unit_label(s, k)} mb{j} was posted before")
        got = self._need_p2p().wait(pending)
        if family == Message.ACT:
            self.acts[(s, j)] = got
        else:
            (self.igrads if family == Message.GRAD else self.ckpts)[(s, k, j)] = got

    def _offload(self, op: Op) -> None:
        unit = (op.stage, op.sub)
        host = self.optimizer.host_grads.get(unit)
        if host is None:
            raise RuntimeError(f"{unit_label(*unit)} is not owned by rank {self.rank}: no host gradient buffer")
        self.optimizer.offloaded(unit, self.grads.offload(unit, host))

    def _optim_step(self, op: Op) -> None:
        unit = (op.stage, op.sub)
        if op.is_async:
            self.optimizer.submit(unit, lr=self.ctx.lr, scale=self.ctx.scale)
        else:
            self.optimizer.step_sync(unit, lr=self.ctx.lr)

    def _validate(self, op: Op) -> None:
        self.wait_sends()
        left = self.leftovers()
        if left:
            raise RuntimeError(
                f"tensors left over at the end of the step: {', '.join(left[:8])}; the op list does not "
                f"consume what it produces"
            )
        if self.schedule.options.async_optimizer:
            self.optimizer.validate_async(lr=self.ctx.lr)
        else:
            self.optimizer.validate_sync(scale=self.ctx.scale)
