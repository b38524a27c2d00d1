"""Joining the process group without an unbounded, signal-deaf wait.

``torch.distributed.init_process_group`` blocks in C++ (the TCP store's connect retries, the
ranks' first barrier) for the process group's timeout, and no Python signal handler runs until it
returns: a rank whose peers never come kept a terminal for 20 minutes, deaf to Ctrl-C and SIGTERM.
:func:`join` runs the call on a helper thread and waits for it in short slices, so a signal stops
the wait at once and ``schedule.timeout_s`` bounds it. The helper thread is then left blocked
(:func:`abandoned`): the process must end with ``os._exit`` after its cleanup, as
:func:`sysx.train.exit_status` does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from sysx import stopping
from sysx.peers import PeerTimeout

SLICE_S = 0.1  # how often the waiting main thread looks at signals

_abandoned = False


class RendezvousTimeout(PeerTimeout):
    """The ranks did not all join within ``schedule.timeout_s``."""


def join(start: Callable[[], None], *, rank: int, world_size: int, timeout_s: float) -> None:
    """Run ``start`` (the process group's creation) and wait for it at most ``timeout_s`` seconds.

    A signal raises :class:`sysx.stopping.JobStopped`; the timeout raises :class:`RendezvousTimeout`
    naming the rank, the rendezvous address and the fix; an error of ``start`` is raised as it is."""
    global _abandoned
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start()
        except BaseException as err:  # handed to the waiting thread, which raises it
            errors.append(err)

    thread = threading.Thread(target=run, name="sysx-rendezvous", daemon=True)
    deadline = time.monotonic() + timeout_s
    thread.start()
    try:
        while thread.is_alive():
            thread.join(SLICE_S)  # a signal handler may raise JobStopped right here
            if thread.is_alive():
                stopping.raise_if_requested()
                if time.monotonic() >= deadline:
                    raise RendezvousTimeout(_timeout_message(rank, world_size, timeout_s))
    except BaseException:
        _abandoned = thread.is_alive()
        raise
    if errors:
        raise errors[0]


def _timeout_message(rank: int, world_size: int, timeout_s: float) -> str:
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"rank {rank}: joining the job's {world_size} ranks at {address} did not complete within {timeout_s:g} s "
        f"(schedule.timeout_s); check that every rank was started with the same MASTER_ADDR, MASTER_PORT "
        f"and WORLD_SIZE, or raise schedule.timeout_s if the ranks start far apart"
    )


def abandoned() -> bool:
    """True when a stop or the timeout left the process group's creation blocked on the helper thread."""
    return _abandoned
