"""What every metrics backend offers: write one step's record, close."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class MetricsBackend(Protocol):
    """One destination of the per-step records (a file, an event directory, a W&B run)."""

    where: str  # what the closing line names (a path, with the W&B mode)

    def write(self, record: Mapping[str, Any]) -> None:
        """Add one step's record (``record["step"]`` is its 0-based step)."""

    def close(self, *, failed: bool = False) -> None:
        """Flush and release; ``failed``: the run ends by an error or a stop. Idempotent."""
