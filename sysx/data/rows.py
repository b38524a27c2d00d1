"""Rows of instruction data from local files, read through Hugging Face ``datasets`` (nothing fetched).

JSONL/JSON, Parquet and Arrow files go through ``load_dataset("json" | "parquet" | "arrow",
data_files=...)``; a ``Dataset.save_to_disk`` folder through ``load_from_disk``. Several inputs are
concatenated in the order given (rows are numbered from 1 across them, for the bad-row report).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sysx.data.errors import DataError
from sysx.data.sample_tokenizer import import_finetune

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in SAVED_MARKERS)


def is_row_input(path: str | Path) -> bool:
    """Whether ``sysx data prepare`` reads ``path`` as rows (JSONL, Parquet, Arrow, a saved dataset)."""
    path = Path(path).expanduser()
    return path.suffix.lower() in BUILDERS or is_saved_dataset(path)


def _first_line(exc: BaseException) -> str:
    """The first line of the innermost cause (datasets wraps pyarrow's "JSON parse error ... in row 1")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_one(path: Path, datasets: Any) -> Any:
    if not path.exists():
        raise DataError(f"input not found: {path}")
    try:
        if is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                names = list(loaded)
                if "train" not in loaded and len(names) != 1:
                    raise DataError(f"{path} holds splits {', '.join(names)} and no 'train'; save the one to prepare")
                loaded = loaded["train" if "train" in loaded else names[0]]
            return loaded
        if path.is_dir():
            raise DataError(
                f"{path} is a folder but not a datasets.save_to_disk folder; name its .jsonl/.parquet files"
            )
        builder = BUILDERS[path.suffix.lower()]
        return datasets.load_dataset(builder, data_files=[str(path)], split="train")
    except DataError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for an unreadable file
        raise DataError(f"cannot read {path} with datasets: {_first_line(exc)}") from None


def load_rows(inputs: Sequence[str | Path]) -> Any:
    """One ``datasets.Dataset`` holding the rows of every input, in order."""
    datasets = import_finetune("datasets")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line
    parts = [_load_one(Path(item).expanduser(), datasets) for item in inputs]
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except Exception as exc:  # different columns or types
        raise DataError(f"the inputs do not share their columns and types: {_first_line(exc)}") from None
