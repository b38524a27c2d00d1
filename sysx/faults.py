"""Fault injection for testing how a multi-process job fails: ``SYSX_FAULT=KIND@RANK:LABEL``.

When rank ``RANK`` announces that it starts ``LABEL`` (what :meth:`sysx.peers.PeerWatch.doing`
publishes, e.g. ``step 2``), the fault happens there, in the middle of the job:

* ``raise``: :class:`InjectedFault` (a ``RuntimeError``), as a bug in the step would raise;
* ``kill``: SIGKILL to the rank itself, as the OOM killer would (no Python code runs after it).

E.g. ``SYSX_FAULT='raise@1:step 2'``. Unset (the default) nothing happens; a malformed value is
an error at the first announcement, not a silently healthy run.
"""

from __future__ import annotations

import os
import signal

ENV = "SYSX_FAULT"
KINDS = ("raise", "kill")


class InjectedFault(RuntimeError):
    """The fault ``SYSX_FAULT`` asked for."""


def parse(spec: str) -> tuple[str, int, str]:
    """``KIND@RANK:LABEL`` -> ``(kind, rank, label)``; ``ValueError`` naming the format otherwise."""
    kind, _, rest = spec.partition("@")
    rank, _, label = rest.partition(":")
    if kind not in KINDS or not rank.strip().isdigit() or not label.strip():
        raise ValueError(f"{ENV}={spec!r} is not valid: expected KIND@RANK:LABEL, KIND one of {', '.join(KINDS)}")
    return kind, int(rank), label.strip()


def at(rank: int, label: str) -> None:
    """Inject the fault ``SYSX_FAULT`` names if ``rank`` is starting ``label`` (else nothing)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    kind, fault_rank, fault_label = parse(spec)
    if (rank, label) != (fault_rank, fault_label):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"{ENV}: fault injected on rank {rank} at {label}")
