"""``run_dir/metrics.jsonl``: one JSON object per step, flushed at once, so a crash loses nothing
already logged. A resumed run keeps the earlier run's records of the steps before it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

METRICS_FILE = "metrics.jsonl"


def _open_metrics(path: Path, first_step: int) -> IO[str]:
    """``metrics.jsonl`` for appending: a fresh file, or for a run resumed at ``first_step`` the
    earlier run's records of the steps before it (steps it did after its last checkpoint are redone)."""
    kept: list[str] = []
    if first_step > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) < first_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the crash that made the resume necessary
    f = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - the backend holds it open and closes it
    f.writelines(kept)
    return f


class JsonlBackend:
    """Writes each record as one line of ``path`` (``null`` for a missing or non-finite number)."""

    def __init__(self, path: Path, first_step: int = 0) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self._file: IO[str] | None = _open_metrics(self.path, first_step)

    def write(self, record: Mapping[str, Any]) -> None:
        """One line, flushed."""
        if self._file is not None:
            self._file.write(json.dumps(dict(record)) + "\n")
            self._file.flush()

    def close(self, *, failed: bool = False) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
