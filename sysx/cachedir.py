"""Where sysx keeps what it builds once and reuses: ``$SYSX_CACHE_DIR``, else platformdirs'
``user_cache_dir("sysx")`` (the default corpus under ``data/``, machine profiles under ``autotune/``)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """The sysx cache directory (not created here)."""
    return Path(os.environ.get("SYSX_CACHE_DIR") or platformdirs.user_cache_dir("sysx")).expanduser()
