"""Open a checkpoint and read what one rank needs of it: its layers, and the trainer's state."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sysx.checkpoint.layer_state import LayerState, decode_layer
from sysx.checkpoint.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TRAINER_STATE,
    CheckpointDir,
    CheckpointError,
    layer_filename,
)

RESUME_CHOICES = ("auto", "none")  # or a path


class Checkpoint:
    """A complete checkpoint folder; every file read is checked against the manifest's size and sha256."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise CheckpointError(
                f"{self.path} is not a complete sysx checkpoint (no {MANIFEST}); give a folder "
                f"step-<N> inside checkpoint.dir, or the checkpoint.dir itself"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(manifest.read_text())
        except ValueError as err:
            raise CheckpointError(f"{manifest} is not valid JSON ({err}); the checkpoint is damaged") from None
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest}: format {self.manifest.get('format')!r} is not {FORMAT!r}")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest}: format version {self.manifest.get('format_version')} is not supported "
                f"(this sysx reads version {FORMAT_VERSION})"
            )

    @property
    def step(self) -> int:
        """Steps done when it was saved (the step a resumed run starts at)."""
        return int(self.manifest["step"])

    @property
    def model(self) -> dict[str, Any]:
        """The model shape it was saved with (``ModelConfig`` fields)."""
        return dict(self.manifest["model"])

    def model_mismatch(self, current: dict[str, Any]) -> str | None:
        """How the saved model shape differs from ``current`` (``ModelConfig`` fields), in words, or None.
        ``max_seq_len`` may differ: positions are not weights."""
        saved = self.model
        for key in sorted(set(saved) | set(current)):
            if key != "max_seq_len" and saved.get(key) != current.get(key):
                return f"the checkpoint's model has {key}={saved.get(key)}, this configuration has {key}={current.get(key)}"
        return None

    def _info(self, name: str) -> dict[str, Any]:
        info = self.manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: the manifest lists no file {name}")
        return dict(info)

    def _damaged(self, name: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path / name}: size or checksum differs from the manifest; the checkpoint is "
            f"damaged (resume from an older one: train.resume=<path>)"
        )

    def _unreadable(self, name: str, err: OSError) -> CheckpointError:
        return CheckpointError(f"{self.path / name}: cannot read ({err.strerror}); the checkpoint is damaged")

    def read(self, name: str) -> bytes:
        """The bytes of one file, checked against the manifest."""
        info = self._info(name)
        try:
            data = (self.path / name).read_bytes()
        except OSError as err:
            raise self._unreadable(name, err) from None
        if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise self._damaged(name)
        return data

    def verify(self, name: str, *, chunk_bytes: int = 8 << 20) -> Path:
        """Check one file against the manifest reading ``chunk_bytes`` at a time (never the whole
        file in memory); returns its path."""
        info = self._info(name)
        digest = hashlib.sha256()
        size = 0
        try:
            with open(self.path / name, "rb", buffering=0) as f:
                while chunk := f.read(chunk_bytes):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as err:
            raise self._unreadable(name, err) from None
        if size != info["bytes"] or digest.hexdigest() != info["sha256"]:
            raise self._damaged(name)
        return self.path / name

    def layer(self, index: int) -> LayerState:
        """Flat layer ``index``'s weights, Adam moments and step count."""
        return decode_layer(self.read(layer_filename(index)), index)

    def trainer_state(self) -> dict[str, Any]:
        """What rank 0 saved besides the layers (step, loss scaler, RNG states, config)."""
        return json.loads(self.read(TRAINER_STATE))


def find_resume(spec: str, checkpoint_dir: str | Path) -> Checkpoint | None:
    """``train.resume``: ``auto`` (the latest complete checkpoint in ``checkpoint_dir``, or None),
    ``none`` (None), or a path (a checkpoint folder, or a checkpoint dir whose latest is taken)."""
    if spec == "none":
        return None
    if spec == "auto":
        latest = CheckpointDir(checkpoint_dir).latest()
        return Checkpoint(latest) if latest is not None else None
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"train.resume={spec}: no such file or folder; give a checkpoint folder, auto or none")
    if (path / MANIFEST).is_file():
        return Checkpoint(path)
    latest = CheckpointDir(path).latest()
    if latest is None:
        raise CheckpointError(f"train.resume={spec}: no complete checkpoint there (no step-<N>/{MANIFEST})")
    return Checkpoint(latest)
