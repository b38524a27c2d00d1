"""The default corpus: byte-level tokens of this Python's own standard-library ``.py`` sources.

No download: the files are on every machine that runs sysx. They are taken in sorted path order
(skipping site-packages, test suites and generated tables) up to ``DEFAULT_MAX_BYTES``, each
preceded by a ``# ==== <path> ====`` line, so the corpus is deterministic for a given Python. The
token file is built once and cached in ``$SYSX_CACHE_DIR/data`` (default: platformdirs'
``user_cache_dir("sysx")/data``); its name holds the Python version and a hash of the file list.
Concurrent builders (ranks, processes) serialise on a file lock and publish with ``os.replace``, so
nobody ever sees a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sysx.cachedir import cache_root
from sysx.data.errors import DataError
from sysx.data.format import TokenWriter, check_dtype, meta_path_for, read_meta
from sysx.data.tokenizer import ByteTokenizer

CORPUS_VERSION = 1
DEFAULT_MAX_BYTES = 12 * 2**20  # ~10 MB of sources on CPython 3.11: builds in well under a second
MIN_BYTES = 2**20  # less than this is not a useful corpus: the Python install has no sources
VAL_FRACTION = 0.01
# Directories skipped anywhere in the tree: installed packages, test suites, caches, generated tables.
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


def cache_dir() -> Path:
    """Where sysx caches data: ``$SYSX_CACHE_DIR/data`` or ``user_cache_dir("sysx")/data``."""
    return cache_root() / "data"


def stdlib_dir() -> Path:
    """This interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, int]]:
    """``(relative posix path, size)`` of the corpus files under ``root``, sorted, capped at ``max_bytes``."""
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    found.sort()
    chosen, total = [], 0
    for rel, size in found:
        if total + size > max_bytes:
            break
        chosen.append((rel, size))
        total += size
    return chosen


def corpus_key(sources: list[tuple[str, int]], max_bytes: int) -> str:
    """Cache key: corpus version, Python implementation and version, cap, and the file list."""
    payload = json.dumps(
        [CORPUS_VERSION, sys.implementation.name, list(sys.version_info[:3]), max_bytes, VAL_FRACTION, sources]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _is_complete(bin_path: Path) -> bool:
    """True if ``bin_path`` and its metadata exist and agree on the size (else it is (re)built)."""
    meta_path = meta_path_for(bin_path)
    if not (bin_path.is_file() and meta_path.is_file()):
        return False
    try:
        meta = read_meta(meta_path)
        return bin_path.stat().st_size == int(meta["num_tokens"]) * check_dtype(meta["dtype"]).itemsize
    except (KeyError, TypeError, ValueError):  # DataError is a ValueError: unreadable metadata -> rebuild
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``path`` (POSIX ``flock``); where flock is missing, atomic renames alone keep readers safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build(bin_path: Path, root: Path, sources: list[tuple[str, int]], progress: bool) -> None:
    tok = ByteTokenizer()
    total = sum(size for _, size in sources)
    with TokenWriter(bin_path, vocab_size=tok.vocab_size, tokenizer=tok.describe(), dtype="uint16") as writer:
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="default corpus", delay=1.0, disable=not progress
        ) as bar:
            for rel, size in sources:
                data = (root / rel).read_bytes()
                if data and not data.endswith(b"\n"):
                    data += b"\n"
                writer.write(np.frombuffer(f"# ==== {rel} ====\n".encode() + data, dtype=np.uint8))
                bar.update(size)
        source = {
            "kind": "python-stdlib",
            "root": str(root),
            "python": ".".join(map(str, sys.version_info[:3])),
            "files": len(sources),
            "bytes": total,
        }
        writer.finish(val_fraction=VAL_FRACTION, source=source)


def ensure_default_corpus(
    *, root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, progress: bool = False
) -> tuple[Path, bool]:
    """Path of the default corpus token file, building it if needed; also True if this call built it."""
    root = Path(root) if root is not None else stdlib_dir()
    sources = stdlib_sources(root, max_bytes)
    total = sum(size for _, size in sources)
    if total < MIN_BYTES <= max_bytes:  # (a smaller cap is a deliberate tiny corpus, e.g. in tests)
        raise DataError(
            f"the standard library at {root} has only {total} bytes of .py sources (this Python ships without "
            "sources?); make a token file with `sysx data prepare --input FILES --output data.bin` and train "
            "with `data=file data.path=data.bin`"
        )
    impl = f"{sys.implementation.name}{sys.version_info[0]}{sys.version_info[1]}"
    out_dir = cache_dir()
    bin_path = out_dir / f"stdlib-{impl}-{corpus_key(sources, max_bytes)}.bin"
    if _is_complete(bin_path):
        return bin_path, False
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(bin_path.with_suffix(".lock")):
            if _is_complete(bin_path):  # another process built it while we waited
                return bin_path, False
            _build(bin_path, root, sources, progress)
    except OSError as exc:
        where = "SYSX_CACHE_DIR" if os.environ.get("SYSX_CACHE_DIR") else "the cache directory"
        raise DataError(
            f"{where}={out_dir.parent} is not writable ({exc.strerror or exc}): the default corpus is "
            "built there once; set SYSX_CACHE_DIR to a writable directory"
        ) from None
    return bin_path, True


def default_corpus_path(*, progress: bool = False) -> Path:
    """Byte-level token file of the stdlib ``.py`` sources (built on first use, then cached)."""
    return ensure_default_corpus(progress=progress)[0]
