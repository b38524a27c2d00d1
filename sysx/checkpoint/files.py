"""Durable file operations: write-then-fsync, atomic replace, directory fsync, group-readable modes.

A checkpoint is only as safe as the order in which its bytes reach the disk: file contents first
(``fsync`` of the file), then the rename that publishes them (``fsync`` of the directory holding
the new name). Every writer in :mod:`sysx.checkpoint` goes through these few functions.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

FILE_MODE = 0o640  # readable by the user's group: checkpoints and exports are shared work
DIR_MODE = 0o750


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (new names, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path) -> None:
    """Create ``path`` (and parents) group-readable, whatever the umask."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def write_durable(path: Path, data: bytes | memoryview) -> str:
    """Write ``data`` to a new file ``path`` and fsync it; returns the sha256 hex digest of ``data``."""
    return write_durable_chunks(path, [data])[1]


def write_durable_chunks(path: Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    """Write the concatenation of ``chunks`` to a new file ``path`` and fsync it, holding one chunk
    at a time (a chunk may be reused by the producer once the next is asked for); returns the bytes
    written and their sha256 hex digest."""
    digest = hashlib.sha256()
    total = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            digest.update(view)
            total += len(view)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, FILE_MODE)  # O_CREAT's mode is filtered by the umask
    return total, digest.hexdigest()


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: a reader sees the old bytes or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
