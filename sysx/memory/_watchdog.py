"""The guardian process body (see guardian.py). Stdlib only: it runs as ``python -I -S <this file>``.

Arguments: parent pid, parent start time (ticks), shm directory. Reads ``+ name inode`` and
``- name`` lines (segments) and ``d+ path inode`` and ``d- path`` lines (scratch directories such as
the NVMe tier's state directories) on stdin until end-of-file (the parent is gone), then unlinks each
segment still listed whose name still points at that inode and whose header names the parent as
creator, and removes each directory still listed whose path still points at that inode and whose
``owner.json`` names the parent.
"""

import contextlib
import json
import os
import shutil
import signal
import struct
import sys


def _remove_dirs(dirs: dict, parent: tuple) -> None:
    for path, ino in dirs.items():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if os.stat(path).st_ino != ino:
                continue
            with open(os.path.join(path, "owner.json")) as f:
                owner = json.load(f)
            if (int(owner["pid"]), int(owner["start"])) != parent:
                continue
            shutil.rmtree(path)
            sys.stderr.write(f"sysx guardian: pid {parent[0]} died; removed its scratch directory {path}\n")


def main(argv: list[str]) -> int:
    """Watch the parent through stdin; clean up after it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; we outlive it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parent = (int(argv[0]), int(argv[1]))
    shm_dir = argv[2]
    names: dict[str, int] = {}
    dirs: dict[str, int] = {}
    for line in sys.stdin:
        op, _, rest = line.rstrip("\n").partition(" ")
        if op in ("+", "d+"):
            name, ino = rest.rsplit(" ", 1)
            (names if op == "+" else dirs)[name] = int(ino)
        elif op in ("-", "d-"):
            (names if op == "-" else dirs).pop(rest, None)
    _remove_dirs(dirs, parent)
    for name, ino in names.items():
        path = os.path.join(shm_dir, name.lstrip("/"))
        with contextlib.suppress(OSError, struct.error):
            if os.stat(path).st_ino != ino:
                continue  # the name now belongs to a new segment
            with open(path, "rb") as f:
                creator = struct.unpack_from("<qQ", f.read(40), 24)  # creator_pid, creator_start
            if creator != parent:
                continue
            os.unlink(path)
            sys.stderr.write(f"sysx shm guardian: pid {parent[0]} died; removed its segment {name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
