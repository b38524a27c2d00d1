"""The one-line errors of the configuration: :class:`ConfigError` and the checks that raise it."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the key, the value and the fix."""


def fail(key: str, value: Any, allowed: str) -> None:
    """Raise ``key=value is not valid: allowed``."""
    raise ConfigError(f"{key}={value} is not valid: {allowed}")


def check_choice(key: str, value: Any, choices: Sequence[Any], *, item: Any = None) -> None:
    """``value`` must be one of ``choices`` (``item``: check this element of a list ``value`` instead)."""
    if item is not None and item not in choices:
        fail(key, value, f"{item} is unknown; allowed: {', '.join(str(c) for c in choices)}")
    if item is None and value not in choices:
        fail(key, value, f"allowed: {', '.join(str(c) for c in choices)}")


def check_installed(what: str, module: str, extra: str) -> None:
    """``module`` can be imported, else one line: ``{what} but the {module} package is not installed;
    pip install 'sysx[{extra}]'``. Looks the module up without importing it (fast, no side effects)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules[module] set to None
        found = False
    if not found:
        raise ConfigError(f"{what} but the {module} package is not installed; pip install 'sysx[{extra}]'")


def check_int(key: str, value: int, minimum: int) -> None:
    """``value`` must be an integer of at least ``minimum``."""
    if value < minimum:
        fail(key, value, f"must be an integer >= {minimum}")


def check_positive(key: str, value: float, unit: str = "") -> None:
    """``value`` must be > 0."""
    if not value > 0:
        fail(key, value, f"must be > 0{unit}")


def first_line(err: BaseException) -> str:
    """The first non-blank line of an exception's message (its type name when it has none)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
