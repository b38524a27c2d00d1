"""``sysx nvme list|clean DIR``: see and remove this user's NVMe state directories under ``DIR``
(an ``optim.nvme_dir``). Statuses are those of ``sysx shm``: ``alive`` (creator running),
``stale`` (creator dead: safe to remove), ``creating``, ``broken`` (no owner record), and
``elsewhere`` (created on another host of a shared file system: its liveness is not visible here).
``clean`` removes stale and broken ones; ``clean --all`` every one of this user (the job's own too).
A job's start removes the stale ones in its own ``optim.nvme_dir`` by itself.
"""

from __future__ import annotations

import argparse

from sysx.memory.budget import fmt_bytes
from sysx.optim.nvme.files import WHAT_PREFIX, StateDirInfo, remove_state_dir, scan_state_dirs


def format_table(infos: list[StateDirInfo]) -> str:
    """The ``sysx nvme list`` table."""
    rows = [("DIRECTORY", "JOB", "NODE", "RANK", "SIZE", "PID", "HOST", "STATUS")]
    for info in infos:
        owner = info.owner
        rows.append(
            (
                info.path,
                info.parsed.job,
                info.parsed.node,
                info.parsed.what.removeprefix(WHAT_PREFIX),
                fmt_bytes(info.size),
                str(owner.pid) if owner else "-",
                owner.host if owner else "-",
                info.status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _cmd_list(args: argparse.Namespace) -> int:
    infos = scan_state_dirs(args.dir, job=args.job)
    if not infos:
        print(f"no sysx NVMe state directories of this user in {args.dir}")
        return 0
    print(format_table(infos))
    removable = [i for i in infos if i.removable]
    print(
        f"\n{len(infos)} director(ies), {fmt_bytes(sum(i.size for i in infos))}; {len(removable)} stale"
        + (f": `sysx nvme clean {args.dir}` removes them" if removable else "")
    )
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    infos = scan_state_dirs(args.dir, job=args.job)
    targets = infos if args.all else [i for i in infos if i.removable]
    if not targets:
        print("nothing to remove" + ("" if args.all else " (no stale state directories)"))
        return 0
    freed = 0
    for info in targets:
        if remove_state_dir(info):
            freed += info.size
            print(f"removed {info.path} ({fmt_bytes(info.size)}, {info.status})")
        else:
            print(f"skipped {info.path}: it changed or vanished meanwhile")
    print(f"freed {fmt_bytes(freed)}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``sysx nvme``."""
    parser = argparse.ArgumentParser(
        prog="sysx nvme", description="List and remove this user's NVMe optimizer-state directories."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (
        ("list", _cmd_list, "show state directories: job, node, rank, size, creator, alive/stale"),
        ("clean", _cmd_clean, "remove stale state directories (creator dead)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("dir", help="the optim.nvme_dir to look in")
        p.add_argument("--job", help="only this job id")
        if name == "clean":
            p.add_argument("--all", action="store_true", help="remove every one of this user, live ones too")
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    return int(args.func(args))
