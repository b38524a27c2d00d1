"""Build a real instruction set from this Python's own documentation: one chat per documented function.

    python examples/stdlib_instructions.py --output data/stdlib_chat.jsonl [--limit 2000] [--parquet]

Each line is ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``: the user asks what a
standard-library function does (a few phrasings), the assistant answers with the first paragraph of its
docstring. Answers range from one line to a dozen, as real instruction data does, and the set is the
same on every machine with the same Python. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

MODULES = (
    "json", "os", "os.path", "re", "random", "math", "statistics", "itertools", "functools", "collections",
    "string", "textwrap", "shutil", "pathlib", "datetime", "calendar", "heapq", "bisect", "base64", "hashlib",
    "zlib", "gzip", "csv", "fnmatch", "glob", "difflib", "copy", "operator", "time", "urllib.parse", "html",
    "struct", "secrets", "uuid", "tempfile", "inspect", "ast", "tokenize", "pprint", "argparse", "logging",
    "subprocess", "threading", "queue", "socket", "email.utils", "unicodedata", "decimal", "fractions",
)  # fmt: skip
QUESTIONS = (
    "What does `{name}` do?",
    "Explain the Python function `{name}`.",
    "In Python, what is `{name}` for?",
    "Describe `{name}`{sig} briefly.",
)


def _first_paragraph(doc: str) -> str:
    return inspect.cleandoc(doc).split("\n\n")[0].strip()


def documented_functions() -> Iterator[tuple[str, str, str]]:
    """(qualified name, signature, first docstring paragraph) of the public functions of MODULES."""
    for module_name in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) is None:
                continue
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or len(doc) < 20:
                continue
            try:  # a default that is a function prints its address: dropped, so every run writes the same set
                sig = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                sig = ""
            yield f"{module_name}.{name}", sig, _first_paragraph(doc)


def build(limit: int, seed: int = 0) -> list[dict]:
    """Up to ``limit`` chats (shuffled with ``seed``; the same list for the same Python)."""
    rng = random.Random(seed)
    rows = []
    for name, sig, answer in documented_functions():
        question = rng.choice(QUESTIONS).format(name=name, sig=sig)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    rng.shuffle(rows)
    return rows[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="the .jsonl file to write")
    parser.add_argument("--limit", type=int, default=2000, help="at most this many chats")
    parser.add_argument("--parquet", action="store_true", help="also write <output stem>.parquet (needs pyarrow)")
    args = parser.parse_args(argv)
    rows = build(args.limit)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if args.parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out.with_suffix(".parquet"))
    print(f"wrote {len(rows)} chats to {out} (Python {sys.version.split()[0]} standard library docstrings)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
