"""Fault injection for testing how a multi-process job fails: ``SYSX_FAULT=KIND@RANK:LABEL[#ATTEMPT]``.

When rank ``RANK`` announces that it starts ``LABEL`` (what :meth:`sysx.peers.PeerWatch.doing`
publishes, e.g. ``step 2`` or ``save 4``), the fault happens there, in the middle of the job:

* ``raise``: :class:`InjectedFault` (a ``RuntimeError``), as a bug in the step would raise;
* ``kill``: SIGKILL to the rank itself, as the OOM killer would (no Python code runs after it).

``#ATTEMPT`` limits the fault to one restart attempt of torchrun (``--max-restarts``): it fires only
where ``TORCHELASTIC_RESTART_COUNT`` (0 for the first attempt) equals ``ATTEMPT``, so the restarted
job is not killed again at the same step (on several nodes the count is the job's attempt under
``sysx.launch``, which counts a restart on every node: :func:`sysx.launch.count_every_restart`).
Several faults are separated by commas, e.g.
``SYSX_FAULT='kill@1:step 8#0,kill@1:save 12#1'``. Unset (the default) nothing happens; a malformed
value is an error at the first announcement, not a silently healthy run.
"""

from __future__ import annotations

import os
import signal
from typing import NamedTuple

ENV = "SYSX_FAULT"
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
KINDS = ("raise", "kill")


class InjectedFault(RuntimeError):
    """The fault ``SYSX_FAULT`` asked for."""


class Fault(NamedTuple):
    """One fault of ``SYSX_FAULT``: what happens, on which rank, at which label, in which attempt
    (None: every attempt)."""

    kind: str
    rank: int
    label: str
    attempt: int | None = None


def parse(spec: str) -> list[Fault]:
    """``KIND@RANK:LABEL[#ATTEMPT]``, comma-separated -> the faults; ``ValueError`` naming the format
    otherwise."""
    faults = []
    for one in spec.split(","):
        kind, _, rest = one.strip().partition("@")
        rank, _, target = rest.partition(":")
        label, hashed, attempt = target.partition("#")
        if (
            kind not in KINDS
            or not rank.strip().isdigit()
            or not label.strip()
            or (hashed and not attempt.strip().isdigit())
        ):
            raise ValueError(
                f"{ENV}={spec!r} is not valid: expected KIND@RANK:LABEL[#ATTEMPT] (comma-separated), "
                f"KIND one of {', '.join(KINDS)}"
            )
        faults.append(Fault(kind, int(rank), label.strip(), int(attempt) if hashed else None))
    return faults


def at(rank: int, label: str) -> None:
    """Inject the fault ``SYSX_FAULT`` names if ``rank`` is starting ``label`` in this attempt (else nothing)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    attempt = int(os.environ.get(ATTEMPT_ENV) or 0)
    for fault in parse(spec):
        if (fault.rank, fault.label) != (rank, label) or fault.attempt not in (None, attempt):
            continue
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"{ENV}: fault injected on rank {rank} at {label}")
