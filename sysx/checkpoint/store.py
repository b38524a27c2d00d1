"""The checkpoint directory: where each checkpoint lives, how one is committed, which is the latest.

A checkpoint is a ``step-NNNNNNNN/`` folder (``manifest.json``, ``trainer.json``, one safetensors
file per flat layer) and ``latest`` names the newest. Every rank writes its files into the same
partial folder (:meth:`CheckpointDir.begin`, :meth:`PendingCheckpoint.finish_rank`) and rank 0
commits it (:meth:`PendingCheckpoint.commit`), so a kill at any moment leaves a complete ``latest``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sysx.checkpoint.files import fsync_dir, make_dir, replace_durable, write_durable, write_durable_chunks

FORMAT = "sysx.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
LATEST = "latest"
_FINAL = re.compile(r"^step-(\d{8,})$")
_PARTIAL = re.compile(r"^step-(\d{8,})\.partial-")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and the fix."""


def step_dirname(step: int) -> str:
    """``step-00000200``: sorts by name in step order."""
    return f"step-{step:08d}"


def layer_filename(layer: int) -> str:
    """The file holding flat layer ``layer``'s state."""
    return f"layer-{layer:05d}.safetensors"


@dataclass
class PendingCheckpoint:
    """A checkpoint being written into its partial folder (see docs/architecture.md)."""

    root: Path
    step: int
    path: Path
    written: dict[str, dict[str, Any]] = field(default_factory=dict)

    def write_file(self, name: str, data: bytes, **info: Any) -> None:
        """Write one file of this checkpoint durably and remember its size and checksum."""
        make_dir(self.path)
        digest = write_durable(self.path / name, data)
        self.written[name] = {"bytes": len(data), "sha256": digest, **info}

    def write_stream(self, name: str, chunks: Iterable[bytes | memoryview], **info: Any) -> int:
        """:meth:`write_file` from a stream of chunks (one held at a time); returns the bytes written."""
        make_dir(self.path)
        nbytes, digest = write_durable_chunks(self.path / name, chunks)
        self.written[name] = {"bytes": nbytes, "sha256": digest, **info}
        return nbytes

    def finish_rank(self, rank: int) -> None:
        """Publish this rank's record of what it wrote (the commit waits for one per rank)."""
        make_dir(self.path)
        record = json.dumps({"rank": rank, "files": self.written}, sort_keys=True).encode()
        tmp = self.path / f".rank-{rank}.done.tmp"
        write_durable(tmp, record)
        os.replace(tmp, self.path / f"rank-{rank}.done.json")

    def commit(
        self,
        *,
        world: int,
        manifest: Mapping[str, Any],
        keep: int,
        timeout_s: float = 600.0,
        check: Callable[[], None] | None = None,
    ) -> Path:
        """Rank 0: wait for every rank's record, write the manifest, publish, rotate. Returns the final path.
        ``check`` is called while waiting and may raise (a rank that died will never write its record)."""
        files: dict[str, dict[str, Any]] = {}
        for rank in range(world):
            files.update(self._wait_record(rank, timeout_s, check))
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            **manifest,
            "files": dict(sorted(files.items())),
        }
        write_durable(self.path / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
        for rank in range(world):
            (self.path / f"rank-{rank}.done.json").unlink(missing_ok=True)
        fsync_dir(self.path)
        final = self.root / step_dirname(self.step)
        stale = None
        if final.exists():  # a run resumed from an older checkpoint reaches this step again
            stale = final.with_name(f"{final.name}.partial-replaced-{os.getpid()}")
            os.rename(final, stale)
        os.rename(self.path, final)
        fsync_dir(self.root)
        replace_durable(self.root / LATEST, (final.name + "\n").encode())
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
        CheckpointDir(self.root).rotate(keep, upto_step=self.step)
        return final

    def _wait_record(self, rank: int, timeout_s: float, check: Callable[[], None] | None) -> dict[str, dict[str, Any]]:
        record = self.path / f"rank-{rank}.done.json"
        deadline = time.monotonic() + timeout_s
        while not record.exists():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {self.path}: rank {rank} did not finish writing its layers within "
                    f"{timeout_s:.0f} s; the previous checkpoint stays the latest"
                )
            time.sleep(0.02)
        return json.loads(record.read_text())["files"]


class CheckpointDir:
    """The folder holding a run's checkpoints (``checkpoint.dir``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def begin(self, step: int, tag: str) -> PendingCheckpoint:
        """A new partial checkpoint for ``step``; ``tag`` must be the same on every rank of the save."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
            raise ValueError(f"checkpoint tag {tag!r} may hold letters, digits, '.', '_' and '-' only")
        make_dir(self.root)
        return PendingCheckpoint(self.root, step, self.root / f"{step_dirname(step)}.partial-{tag}")

    def complete(self) -> list[Path]:
        """Complete checkpoints (a manifest of this format), oldest first."""
        found: list[tuple[int, Path]] = []
        if not self.root.is_dir():
            return []
        for path in self.root.iterdir():
            match = _FINAL.match(path.name)
            if match and path.is_dir() and _manifest_ok(path):
                found.append((int(match.group(1)), path))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names if it is complete, else the newest complete one, else None."""
        pointer = self.root / LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if _FINAL.match(named.name) and named.is_dir() and _manifest_ok(named):
                return named
        done = self.complete()
        return done[-1] if done else None

    def rotate(self, keep: int, *, upto_step: int) -> None:
        """Delete complete checkpoints beyond the newest ``keep`` and the partial folders of steps up
        to ``upto_step`` (left by a killed save; a later step's partial may be a save in flight)."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep={keep} must be >= 1")
        latest = self.latest()
        for path in self.complete()[:-keep]:
            if path != latest:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.iterdir():
            match = _PARTIAL.match(path.name)
            if match and int(match.group(1)) <= upto_step:
                shutil.rmtree(path, ignore_errors=True)


def _manifest_ok(path: Path) -> bool:
    try:
        body = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return body.get("format") == FORMAT
