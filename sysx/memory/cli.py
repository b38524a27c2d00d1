"""``sysx shm list|clean``: see and remove this user's sysx shared-memory segments.

``list`` prints every segment with its job, node, size, creator pid and status:

* ``alive``    - its creator is running;
* ``orphaned`` - its creator is dead but some process still maps it;
* ``stale``    - its creator is dead (or its pid was reused) and nobody maps it: safe to remove;
* ``creating`` - just created, header not written yet;
* ``broken``   - no valid header and nobody maps it (creator died while creating it).

``clean`` removes the stale and broken ones; ``clean --all`` removes every sysx segment of this user
(asking first on a terminal unless ``--yes``; never asking when stdin is not a terminal). Both also
show and remove what a killed launcher left of its own (MPICH's ``mpich_shm_*``:
:mod:`sysx.memory.launcher_shm`) once no process of this user uses it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sysx.memory.budget import fmt_bytes, remove_ipc_warning
from sysx.memory.cleanup import SegmentInfo, remove, scan
from sysx.memory.launcher_shm import launcher_leftovers, remove_leftover


def _age(info: SegmentInfo) -> str:
    created = info.header.created_unix if info.header is not None else info.mtime
    seconds = max(0.0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def format_table(infos: list[SegmentInfo]) -> str:
    """The ``sysx shm list`` table."""
    rows = [("NAME", "JOB", "NODE", "WHAT", "SIZE", "PID", "USERS", "AGE", "STATUS")]
    for info in infos:
        parsed = info.parsed
        rows.append(
            (
                info.name,
                parsed.job if parsed else "?",
                parsed.node if parsed else "?",
                parsed.what if parsed else "?",
                fmt_bytes(info.size),
                str(info.creator_pid) if info.creator_pid is not None else "-",
                "?" if info.holders is None else str(len(info.holders)),
                _age(info),
                info.status + (f" ({info.error})" if info.error else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows)


def _launcher_note() -> str:
    """One line on the launcher's leftovers, or "" without any."""
    left = launcher_leftovers()
    if not left:
        return ""
    return (
        f"{len(left)} segment(s) a killed launcher left ({fmt_bytes(sum(x.size for x in left))}, "
        f"e.g. {os.path.basename(left[0].path)}), unused: `sysx shm clean` removes them"
    )


def _cmd_list(args: argparse.Namespace) -> int:
    infos = scan(job=args.job)
    launcher = "" if args.job else _launcher_note()
    if launcher:
        print(launcher)
    if not infos:
        print("no sysx shared-memory segments of this user" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(format_table(infos))
    total = sum(i.size for i in infos)
    removable = [i for i in infos if i.removable]
    print(
        f"\n{len(infos)} segment(s), {fmt_bytes(total)}; {len(removable)} stale "
        f"({fmt_bytes(sum(i.size for i in removable))})" + (": `sysx shm clean` removes them" if removable else "")
    )
    warning = remove_ipc_warning()
    if warning:
        print(f"\nwarning: {warning}")
    return 0


def _confirm(infos: list[SegmentInfo], assume_yes: bool) -> bool:
    if assume_yes or not sys.stdin.isatty():
        return True
    live = [i for i in infos if not i.removable]
    print(format_table(infos))
    if live:
        print(
            f"\n{len(live)} of them are in use by running processes; removing them makes their jobs unable to attach."
        )
    answer = input(f"Remove these {len(infos)} segment(s)? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _clean_launcher_leftovers() -> int:
    """Remove the launcher's unused leftovers (:mod:`sysx.memory.launcher_shm`); returns the bytes freed."""
    freed = 0
    for left in launcher_leftovers():
        if remove_leftover(left):
            freed += left.size
            print(f"removed {left.path} ({fmt_bytes(left.size)}, left by a launcher, unused)")
    return freed


def _cmd_clean(args: argparse.Namespace) -> int:
    infos = scan(job=args.job)
    targets = infos if args.all else [i for i in infos if i.removable]
    launcher_freed = 0 if args.job else _clean_launcher_leftovers()
    if launcher_freed and not targets:
        print(f"freed {fmt_bytes(launcher_freed)}")
        return 0
    if not targets:
        print(
            "nothing to remove"
            + ("" if args.all else " (no stale segments; `--all` removes every sysx segment of this user)")
        )
        return 0
    if args.all and not _confirm(targets, args.yes):
        print("nothing removed")
        return 1
    freed = 0
    for info in targets:
        if remove(info):
            freed += info.size
            print(f"removed {info.name} ({fmt_bytes(info.size)}, {info.status}, creator pid {info.creator_pid})")
        else:
            print(f"skipped {info.name}: it changed or vanished meanwhile")
    print(f"freed {fmt_bytes(freed + launcher_freed)}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``sysx shm``."""
    parser = argparse.ArgumentParser(
        prog="sysx shm", description="List and remove this user's sysx shared-memory segments."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="show segments: job, node, size, creator, alive/stale")
    p_list.add_argument("--job", help="only this job id")
    p_list.set_defaults(func=_cmd_list)
    p_clean = sub.add_parser("clean", help="remove stale segments (creator dead, nobody mapping them)")
    p_clean.add_argument("--all", action="store_true", help="remove every sysx segment of this user, live ones too")
    p_clean.add_argument("--job", help="only this job id")
    p_clean.add_argument("-y", "--yes", action="store_true", help="do not ask before --all")
    p_clean.set_defaults(func=_cmd_clean)
    args = parser.parse_args(argv)
    return int(args.func(args))
