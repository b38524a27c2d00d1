"""``python -m sysx.launch [torchrun options] -m sysx.train ...``: torchrun, with its exit as a job's.

torchrun's own entry point reports a stopped or failed job with a Python traceback of its agent
(``SignalException`` for Ctrl-C / SIGTERM, ``ChildFailedError`` with a report box for a failed
rank) and exits 1 whatever happened. The ranks have already said what happened, in one line each
(:mod:`sysx.stopping`, :mod:`sysx.peers`), so this wrapper runs the same launcher
(``torch.distributed.run``: same options, same agent, same signal forwarding to the workers) and
exits like the job: 130 / 143 after SIGINT / SIGTERM, the failed rank's status otherwise, and prints
at most one line of its own. ``launch/torchrun.sh`` uses it.
"""

from __future__ import annotations

import logging
import signal
import sys


def exit_status(failures: dict) -> int:
    """The status of the first failed rank (``128 + n`` when it died of signal ``n``)."""
    for _, failure in sorted(failures.items()):
        code = int(getattr(failure, "exitcode", 1))
        return 128 - code if code < 0 else code or 1
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the job's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # its shutdown chatter is not the job's
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        status = exit_status(failed.failures)
        if status not in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # a stop was reported by the ranks already
            ranks = ", ".join(str(f.global_rank) for f in failed.failures.values())
            print(
                f"sysx.launch: rank(s) {ranks} failed (exit status {status}); their own lines above say why",
                file=sys.stderr,
                flush=True,
            )
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
