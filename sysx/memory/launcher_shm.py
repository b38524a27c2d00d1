"""Shared-memory segments a launcher's own runtime leaves in ``/dev/shm`` when its job is killed:
MPICH names its node-local segment ``mpich_shm_*`` and unlinks it only once every rank attached, so
a Ctrl-C of ``mpirun`` during start-up leaves it behind. sysx cannot tell which job made one, so a
segment counts as left over only when it is this user's, older than a grace period (its creator may
still be starting), and no process of this user maps it or holds it open. A process of this user
whose memory map cannot be read is not dumpable (a setuid program, or one that asked the kernel to
hide it), which no MPI rank is, so it is passed over.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from sysx.memory.names import SHM_DIR

LAUNCHER_PREFIXES = ("mpich_shm_",)  # MPICH (and MVAPICH, Intel MPI: MPICH's shared-memory code)
GRACE_S = 60.0  # a younger segment may belong to a job between creating and mapping it


@dataclass(frozen=True)
class Leftover:
    """One launcher segment nobody uses any more."""

    path: str
    size: int
    dev: int
    ino: int


def files_in_use(uid: int | None = None) -> set[tuple[int, int]]:
    """``(dev, ino)`` of every file a process of ``uid`` (default: this user) maps or holds open
    (``/proc/<pid>/maps`` and ``/proc/<pid>/fd``; unreadable processes passed over)."""
    uid = os.getuid() if uid is None else uid
    used: set[tuple[int, int]] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        proc = f"/proc/{entry}"
        try:
            if os.stat(proc).st_uid != uid:
                continue
            with open(f"{proc}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[4] != "0":  # a file mapping (anonymous ones have inode 0)
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        used.add((os.makedev(major, minor), int(fields[4])))
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    st = os.stat(f"{proc}/fd/{fd}")
                except OSError:
                    continue  # closed meanwhile
                used.add((st.st_dev, st.st_ino))
        except (FileNotFoundError, PermissionError):
            continue  # ended meanwhile, or not dumpable (see the module doc)
    return used


def launcher_leftovers(shm_dir: str | None = None, *, grace_s: float = GRACE_S) -> list[Leftover]:
    """This user's launcher segments in ``shm_dir`` (default ``/dev/shm``; see the module doc) that no process uses."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    uid = os.getuid()
    candidates = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    now = time.time()
    for entry in entries:
        if not entry.startswith(LAUNCHER_PREFIXES):
            continue
        path = os.path.join(shm_dir, entry)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid == uid and stat.S_ISREG(st.st_mode) and now - st.st_mtime >= grace_s:
            candidates.append(Leftover(path, st.st_size, st.st_dev, st.st_ino))
    if not candidates:
        return []
    used = files_in_use(uid)
    return [c for c in candidates if (c.dev, c.ino) not in used]


def remove_leftover(leftover: Leftover) -> bool:
    """Unlink ``leftover`` unless its name now points at another file."""
    try:
        st = os.lstat(leftover.path)
        if (st.st_dev, st.st_ino) != (leftover.dev, leftover.ino):
            return False
        os.unlink(leftover.path)
    except FileNotFoundError:
        return False
    return True


def sweep_launcher_leftovers(shm_dir: str | None = None) -> list[Leftover]:
    """Remove this user's launcher segments nobody uses; returns what was removed."""
    return [left for left in launcher_leftovers(shm_dir) if remove_leftover(left)]
