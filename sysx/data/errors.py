"""The one exception type of ``sysx.data``."""

from __future__ import annotations


class DataError(ValueError):
    """A problem with token files, their metadata, inputs or sampling arguments (the message says the fix)."""
