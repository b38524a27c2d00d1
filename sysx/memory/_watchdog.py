"""The guardian process body (see guardian.py). Stdlib only: it runs as ``python -I -S <this file>``.

Arguments: parent pid, parent start time (ticks), shm directory. Reads ``+ name inode`` and
``- name`` lines on stdin until end-of-file (the parent is gone), then unlinks each segment still
listed whose name still points at that inode and whose header names the parent as creator.
"""

import contextlib
import os
import signal
import struct
import sys


def main(argv: list[str]) -> int:
    """Watch the parent through stdin; clean up after it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; we outlive it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parent = (int(argv[0]), int(argv[1]))
    shm_dir = argv[2]
    names: dict[str, int] = {}
    for line in sys.stdin:
        op, _, rest = line.strip().partition(" ")
        if op == "+":
            name, ino = rest.rsplit(" ", 1)
            names[name] = int(ino)
        elif op == "-":
            names.pop(rest, None)
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
