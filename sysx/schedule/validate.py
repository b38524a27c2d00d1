"""Prove a schedule executable before any process starts: :func:`validate`.

Checks, each error naming the rank, the op index, the op and what is missing:

1. every op's stage / sub-stage / micro-batch / peer is in range;
2. every forward ``(stage, mb)`` and every backward ``(stage, sub, mb)`` runs exactly once;
3. every send has exactly one matching receive on its peer (same message, same sync/async
   mode) and vice versa, and each pair of ranks posts its messages in the same order (NCCL
   matches a pair's point-to-point messages in posting order, without tags);
4. dependencies on each rank: a forward's input was computed here or received before; a
   backward's checkpoint was produced here or received (and waited for, when asynchronous) and
   its output gradient computed here or received; a send follows the pass that produces its
   data; the parameters of every pass are loaded and not freed; OFFLOAD_GRADS follows all
   micro-batches of its sub-stage on this rank; OPTIM_STEP follows the offload (asynchronous:
   before VALIDATE; synchronous: after it); every sub-stage is offloaded and stepped once;
   every rank validates once and frees every buffer it loaded;
5. the ranks together cannot deadlock: all lists are executed at once with blocking
   semantics (a synchronous send blocks until the matching receive is posted and the other way
   round; WAIT_CKPT blocks until the isend is posted; VALIDATE is a barrier).
"""

from __future__ import annotations

from sysx.schedule.costs import UnitCosts
from sysx.schedule.lower import next_sub
from sysx.schedule.ops import COMMS, PARTNER, RECVS, SENDS, Op, OpKind, Schedule, ScheduleError
from sysx.schedule.simulate import Deadlock, run_program


def _fmt_s(s: int, k: int) -> str:
    return f"s{s}" if k < 0 else f"s{s}.{k}"


def _partner_str(op: Op, rank: int) -> str:
    return str(Op(PARTNER[op.kind], op.stage, op.sub, op.mb, rank, op.is_async))


def validate(schedule: Schedule, *, max_errors: int = 25) -> None:
    """Raise :class:`ScheduleError` listing every problem found (see the module doc); else return."""
    errors: list[str] = []
    R, nm = schedule.n_ranks, schedule.n_micro
    nsf, d = schedule.n_stages, schedule.split
    if len(schedule.ops) != R:
        raise ScheduleError(f"schedule {schedule.name!r} has {len(schedule.ops)} op lists for n_ranks={R}")

    # 1. ranges ----------------------------------------------------------------------------------
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            bad = []
            k = op.kind
            if k != OpKind.VALIDATE and not 0 <= op.stage < nsf:
                bad.append(f"stage {op.stage} not in 0..{nsf - 1}")
            needs_sub = k in (OpKind.BACKWARD, OpKind.SEND_GRAD, OpKind.RECV_GRAD, OpKind.SEND_CKPT,
                              OpKind.RECV_CKPT, OpKind.WAIT_CKPT, OpKind.OFFLOAD_GRADS, OpKind.OPTIM_STEP)
            if needs_sub and not 0 <= op.sub < d:
                bad.append(f"sub-stage {op.sub} not in 0..{d - 1}")
            if k in (OpKind.LOAD_PARAMS, OpKind.FREE) and not -1 <= op.sub < d:
                bad.append(f"sub-stage {op.sub} not in -1..{d - 1}")
            has_mb = k in (OpKind.FORWARD, OpKind.BACKWARD, OpKind.WAIT_CKPT) or k in COMMS
            if has_mb and not 0 <= op.mb < nm:
                bad.append(f"micro-batch {op.mb} not in 0..{nm - 1}")
            if (k in COMMS or k == OpKind.WAIT_CKPT) and not (0 <= op.peer < R and op.peer != r):
                bad.append(f"peer {op.peer} is not another rank in 0..{R - 1}")
            if bad:
                errors.append(f"rank {r} op #{i} `{op}`: " + ", ".join(bad))
    if errors:
        _raise(schedule, errors, max_errors)

    # 2. coverage --------------------------------------------------------------------------------
    seen: dict[tuple, list[tuple[int, int]]] = {}
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            if op.kind == OpKind.FORWARD:
                seen.setdefault(("F", op.stage, -1, op.mb), []).append((r, i))
            elif op.kind == OpKind.BACKWARD:
                seen.setdefault(("B", op.stage, op.sub, op.mb), []).append((r, i))
    for s in range(nsf):
        for j in range(nm):
            for key in [("F", s, -1, j)] + [("B", s, k, j) for k in range(d)]:
                at = seen.get(key, [])
                name = f"{key[0]} {_fmt_s(key[1], key[2])} mb{j}"
                if not at:
                    errors.append(f"`{name}` never runs on any rank")
                elif len(at) > 1:
                    where = ", ".join(f"rank {r} op #{i}" for r, i in at)
                    errors.append(f"`{name}` runs {len(at)} times ({where}); every pass must run exactly once")

    # 3. pairing and per-pair order -------------------------------------------------------------
    sends: dict[tuple, list[tuple[int, int, Op]]] = {}
    recvs: dict[tuple, list[tuple[int, int, Op]]] = {}
    order: dict[tuple[int, int, str], list[tuple[tuple, int, Op]]] = {}
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            if op.kind in SENDS:
                key = (op.message, r, op.peer)
                sends.setdefault(key, []).append((r, i, op))
                order.setdefault((r, op.peer, "s"), []).append((key, i, op))
            elif op.kind in RECVS:
                key = (op.message, op.peer, r)
                recvs.setdefault(key, []).append((r, i, op))
                order.setdefault((op.peer, r, "r"), []).append((key, i, op))
    pair_errors = 0
    for key, lst in sends.items():
        r, i, op = lst[0]
        if len(lst) > 1:
            errors.append(f"rank {r} sends `{op}` {len(lst)} times (ops " + ", ".join(f"#{x[1]}" for x in lst) + ")")
            pair_errors += 1
        if key not in recvs:
            errors.append(f"rank {r} op #{i} `{op}` has no matching `{_partner_str(op, r)}` on rank {op.peer}")
            pair_errors += 1
        elif recvs[key][0][2].is_async != op.is_async:
            ro = recvs[key][0]
            errors.append(f"rank {r} op #{i} `{op}` is matched by `{ro[2]}` (rank {ro[0]} op #{ro[1]}) in the other "
                          f"mode; post both sides sync or both async")
            pair_errors += 1
    for key, lst in recvs.items():
        r, i, op = lst[0]
        if len(lst) > 1:
            errors.append(f"rank {r} receives `{op}` {len(lst)} times (ops " + ", ".join(f"#{x[1]}" for x in lst) + ")")
            pair_errors += 1
        if key not in sends:
            errors.append(f"rank {r} op #{i} `{op}` has no matching `{_partner_str(op, r)}` on rank {op.peer}")
            pair_errors += 1
    if not pair_errors:
        for (a, b, side), lst in order.items():
            if side != "s":
                continue
            other = order.get((a, b, "r"), [])
            for n, ((ks, i_s, op_s), (kr, i_r, op_r)) in enumerate(zip(lst, other)):
                if ks != kr:
                    errors.append(
                        f"ranks {a} and {b} post their messages in different orders: message {n} from rank {a} to "
                        f"rank {b} is `{op_s}` (rank {a} op #{i_s}) but rank {b}'s receive {n} from rank {a} is "
                        f"`{op_r}` (op #{i_r}); NCCL matches a pair's messages in posting order, so post them "
                        f"in the same order on both ranks")
                    pair_errors += 1
                    break

    # 4. per-rank dependencies ------------------------------------------------------------------
    offloaded: dict[tuple[int, int], int] = {}
    stepped: dict[tuple[int, int], int] = {}
    layers = schedule.partition.layers
    for r, ops in enumerate(schedule.ops):
        done_f: set[tuple[int, int]] = set()
        done_b: set[tuple[int, int, int]] = set()
        got_act: set[tuple[int, int]] = set()
        got_grad: set[tuple[int, int, int]] = set()
        posted: set[tuple[int, int, int]] = set()
        ready_ck: set[tuple[int, int, int]] = set()
        resident: dict[tuple[int, int], range] = {}
        local_off: set[tuple[int, int]] = set()
        validated = -1
        for i, op in enumerate(ops):
            k = op.kind
            here = f"rank {r} op #{i} `{op}`"
            if validated >= 0 and not (k == OpKind.OPTIM_STEP and not op.is_async) and k != OpKind.FREE:
                errors.append(f"{here} comes after VALIDATE (op #{validated}); only synchronous OPTIM_STEPs may follow it")
            if k in (OpKind.FORWARD, OpKind.BACKWARD):
                need = layers(op.stage, -1 if k == OpKind.FORWARD else op.sub)
                if not any(u.start <= need.start and need.stop <= u.stop for u in resident.values()):
                    errors.append(f"{here}: the parameters of layers {need.start}..{need.stop - 1} are not loaded "
                                  f"(no earlier LOAD_PARAMS covering them without a FREE since)")
            if k == OpKind.FORWARD:
                if op.stage > 0 and (op.stage - 1, op.mb) not in done_f and (op.stage - 1, op.mb) not in got_act:
                    errors.append(f"{here}: its input (output of stage {op.stage - 1}, mb {op.mb}) was neither "
                                  f"computed on this rank nor received before (missing `RECV_ACT s{op.stage - 1} mb{op.mb}`)")
                done_f.add((op.stage, op.mb))
            elif k == OpKind.BACKWARD:
                key = (op.stage, op.sub, op.mb)
                if (op.stage, op.mb) not in done_f and key not in ready_ck:
                    why = ("its async RECV_CKPT was posted but no WAIT_CKPT precedes it" if key in posted
                           else f"no earlier `F s{op.stage} mb{op.mb}` here and no RECV_CKPT")
                    errors.append(f"{here}: checkpoint of s{op.stage}.{op.sub} mb{op.mb} not available: {why}")
                nxt = next_sub(op.stage, op.sub, nsf, d)
                if nxt is not None and (nxt[0], nxt[1], op.mb) not in done_b and (nxt[0], nxt[1], op.mb) not in got_grad:
                    errors.append(f"{here}: its output gradient (from `B {_fmt_s(*nxt)} mb{op.mb}`) was neither "
                                  f"computed on this rank nor received before (missing `RECV_GRAD {_fmt_s(*nxt)} mb{op.mb}`)")
                done_b.add(key)
            elif k == OpKind.SEND_ACT:
                if (op.stage, op.mb) not in done_f:
                    errors.append(f"{here}: sends the output of `F s{op.stage} mb{op.mb}` before computing it here")
            elif k == OpKind.SEND_GRAD:
                if (op.stage, op.sub, op.mb) not in done_b:
                    errors.append(f"{here}: sends the input gradient of `B s{op.stage}.{op.sub} mb{op.mb}` before computing it here")
            elif k == OpKind.SEND_CKPT:
                if (op.stage, op.mb) not in done_f:
                    errors.append(f"{here}: sends a checkpoint of `F s{op.stage} mb{op.mb}` before computing it here")
            elif k == OpKind.RECV_ACT:
                got_act.add((op.stage, op.mb))
            elif k == OpKind.RECV_GRAD:
                got_grad.add((op.stage, op.sub, op.mb))
            elif k == OpKind.RECV_CKPT:
                (posted if op.is_async else ready_ck).add((op.stage, op.sub, op.mb))
            elif k == OpKind.WAIT_CKPT:
                key = (op.stage, op.sub, op.mb)
                if key not in posted:
                    errors.append(f"{here}: waits for a checkpoint whose async RECV_CKPT was not posted before")
                ready_ck.add(key)
            elif k == OpKind.LOAD_PARAMS:
                u = (op.stage, op.sub)
                if u in resident:
                    errors.append(f"{here}: {_fmt_s(*u)} is already loaded (no FREE since the last LOAD_PARAMS)")
                resident[u] = layers(op.stage, op.sub)
            elif k == OpKind.FREE:
                u = (op.stage, op.sub)
                if u not in resident:
                    errors.append(f"{here}: frees {_fmt_s(*u)}, which is not loaded")
                resident.pop(u, None)
            elif k == OpKind.OFFLOAD_GRADS:
                g = (op.stage, op.sub)
                miss = [j for j in range(nm) if (op.stage, op.sub, j) not in done_b]
                if miss:
                    errors.append(f"{here}: the backward of micro-batch(es) {miss} of s{op.stage}.{op.sub} did not run on "
                                  f"this rank before; a sub-stage's gradients must accumulate on one rank")
                if g in offloaded:
                    errors.append(f"{here}: s{op.stage}.{op.sub} is offloaded twice")
                offloaded[g] = r
                local_off.add(g)
            elif k == OpKind.OPTIM_STEP:
                g = (op.stage, op.sub)
                if g not in local_off:
                    errors.append(f"{here}: steps s{op.stage}.{op.sub} before its OFFLOAD_GRADS on this rank")
                if not op.is_async and validated < 0:
                    errors.append(f"{here}: a synchronous optimizer step must follow VALIDATE (the overflow check)")
                if g in stepped:
                    errors.append(f"{here}: s{op.stage}.{op.sub} is stepped twice")
                stepped[g] = r
            elif k == OpKind.VALIDATE:
                if validated >= 0:
                    errors.append(f"{here}: second VALIDATE on this rank (first at op #{validated})")
                validated = i
        if validated < 0:
            errors.append(f"rank {r} never runs VALIDATE (the all-reduce of overflow flags every rank joins)")
        if resident:
            errors.append(f"rank {r} never frees " + ", ".join(_fmt_s(*u) for u in resident) + " (add FREE after the last use)")
    for s in range(nsf):
        for k in range(d):
            if (s, k) not in offloaded:
                errors.append(f"OFFLOAD_GRADS s{s}.{k} is missing (after its last backward)")
            if (s, k) not in stepped:
                errors.append(f"OPTIM_STEP s{s}.{k} is missing")

    # checkpoint plan --------------------------------------------------------------------------------
    for rt in schedule.ckpt_plan:
        if rt.mode == "local":
            continue
        for rank, idx, kind in ((rt.src, rt.src_index, OpKind.SEND_CKPT), (rt.dst, rt.dst_index, OpKind.RECV_CKPT)):
            ops = schedule.ops[rank] if 0 <= rank < R else ()
            op = ops[idx] if 0 <= idx < len(ops) else None
            if op is None or op.kind != kind or (op.stage, op.sub, op.mb) != (rt.stage, rt.sub, rt.mb):
                errors.append(f"checkpoint plan entry s{rt.stage}.{rt.sub} mb{rt.mb} ({rt.src}->{rt.dst}) points at "
                              f"rank {rank} op #{idx} `{op}`, not a {kind.name} of that checkpoint")

    if errors:
        _raise(schedule, errors, max_errors)

    # 5. deadlock freedom, by executing all ranks together ------------------------------------------
    try:
        run_program(schedule, UnitCosts(0.0, 0.0, 0.0).table(schedule), rendezvous=True, record=False, memory=False)
    except Deadlock as err:
        raise ScheduleError(str(err)) from None


def _raise(schedule: Schedule, errors: list[str], max_errors: int) -> None:
    shown = errors[:max_errors]
    more = f"\n  ... and {len(errors) - max_errors} more" if len(errors) > max_errors else ""
    raise ScheduleError(f"schedule {schedule.name!r} is invalid ({len(errors)} problem(s)):\n  - "
                        + "\n  - ".join(shown) + more)
