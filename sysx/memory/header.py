"""The header page of a sysx shared-memory segment: its byte layout, encoding and decoding.

Mapping a segment (segment.py), sizing one (budget.py) and inspecting one without mapping it
(cleanup.py) all read this layout, so it lives here, below all three.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from sysx.memory import procinfo

MAGIC = b"SYSXSHM\x00"
LAYOUT_VERSION = 1
HEADER_BYTES = max(4096, mmap.PAGESIZE)
_FIXED = struct.Struct("<8sIIIIqQQd")
STATE_OFFSET = 16  # byte offset of ``state``
CREATOR_OFFSET = 24  # byte offset of ``creator_pid, creator_start`` (``<qQ``; _watchdog.py reads it)
STATE_CREATING, STATE_READY, STATE_CLOSING = 0, 1, 2


class SegmentError(RuntimeError):
    """A shared-memory segment could not be created, attached or released."""


@dataclass(frozen=True)
class Header:
    """The decoded header of a segment."""

    layout_version: int
    header_bytes: int
    state: int
    creator_pid: int
    creator_start: int
    data_bytes: int
    created_unix: float
    meta: dict[str, Any]

    def pack(self) -> bytes:
        """Encode (raises if the metadata does not fit in the header page)."""
        meta = json.dumps(self.meta, separators=(",", ":")).encode()
        if _FIXED.size + len(meta) > self.header_bytes:
            raise ValueError(f"segment metadata is {len(meta)} bytes; at most {self.header_bytes - _FIXED.size} fit")
        fixed = _FIXED.pack(
            MAGIC,
            self.layout_version,
            self.header_bytes,
            self.state,
            len(meta),
            self.creator_pid,
            self.creator_start,
            self.data_bytes,
            self.created_unix,
        )
        return fixed + meta

    @property
    def creator_alive(self) -> bool:
        """True while the creating process (same pid and start time) is running."""
        return procinfo.is_alive(self.creator_pid, self.creator_start)


def read_header(fd: int, name: str) -> Header | None:
    """The header of the open segment ``fd``; None while it is still being created (all zero).

    Raises SegmentError for a segment that is not sysx's or has another layout version.
    """
    raw = os.pread(fd, HEADER_BYTES, 0)
    if len(raw) < _FIXED.size or raw[:8] == b"\x00" * 8:
        return None
    magic, version, header_bytes, state, meta_len, pid, start, data_bytes, created = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise SegmentError(f"{name} is not a sysx segment (magic {magic!r}); leave it alone or remove it by hand")
    if version != LAYOUT_VERSION:
        raise SegmentError(
            f"{name} has layout version {version}; this sysx reads version {LAYOUT_VERSION}. "
            "Use the same sysx version in every process of a job (`sysx shm list` shows who created it)"
        )
    meta = json.loads(raw[_FIXED.size : _FIXED.size + meta_len] or b"{}")
    return Header(version, header_bytes, state, pid, start, data_bytes, created, meta)


def segment_bytes(data_bytes: int) -> int:
    """Total size of a segment holding ``data_bytes`` of payload (header page + payload, exact)."""
    return HEADER_BYTES + data_bytes
