"""What a simulated schedule that cannot finish reports: :class:`Deadlock`, naming for every
unfinished rank the op it waits at and for what (:func:`deadlock_report`, from the engine's state)."""

from __future__ import annotations

from sysx.schedule.ops import MESSAGE_OF, PARTNER, SEND_OF, WAITS, Op, Schedule, ScheduleError


class Deadlock(ScheduleError):
    """The ranks wait for each other; ``stuck`` lists (rank, op index, op, reason)."""

    def __init__(self, message: str, stuck: list[tuple[int, int, Op, str]]):
        super().__init__(message)
        self.stuck = stuck


def deadlock_report(schedule: Schedule, current: list[int | None], pcs: list[int], blocked_on: list[str]) -> Deadlock:
    """The :class:`Deadlock` naming, for every unfinished rank, the op it waits at and for what:
    ``current[r]`` is the index in rank r's op list of the op it is at (None: finished), ``pcs[r]``
    its instruction counter and ``blocked_on[r]`` why it waits."""
    stuck = []
    for r, i in enumerate(current):
        if i is not None:
            stuck.append((r, i, schedule.ops[r][i], blocked_on[r]))
    lines = []
    for r, i, op, why in stuck:
        if why == "validate":
            lines.append(f"rank {r} op #{i} `{op}` waits at the VALIDATE barrier")
        elif why == "offload":
            whose = f"rank {op.peer}" if op.peer >= 0 else "this rank"
            lines.append(f"rank {r} op #{i} `{op}` waits for {whose} to offload the gradients it steps")
        elif op.kind in WAITS:
            family = MESSAGE_OF[op.kind]
            sent = Op(SEND_OF[family], op.stage, op.sub, op.mb, r, True)
            lines.append(
                f"rank {r} op #{i} `{op}` waits for the {family.noun} from rank {op.peer} (`{sent}` never posted)"
            )
        else:
            partner = PARTNER[op.kind].name if op.kind in PARTNER else "?"
            at, theirs = pcs[op.peer], current[op.peer]
            where = f" `{schedule.ops[op.peer][theirs]}`)" if theirs is not None else ", finished)"
            lines.append(
                f"rank {r} op #{i} `{op}` waits for rank {op.peer} to reach its {partner} "
                f"(rank {op.peer} is at op #{at}" + where
            )
    return Deadlock(f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines), stuck)
