"""One line per configuration key for ``sysx-train --help``, read from the schema itself: the comment
beside (or just above) each field of the dataclasses in :mod:`sysx.config.sections` and
:mod:`sysx.config.schema`, so the description lives once, where the key is defined."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from typing import Any, get_type_hints

from sysx.config.schema import SysxConfig


def describe_keys(values: Any) -> str:
    """``--help``'s key list: ``key=value`` (the composed value) and its description, one line per key."""
    docs = key_descriptions()
    shown = {key: f"{key}={_show(value)}" for key, value in _flatten(dict(values)).items()}
    width = max(map(len, shown.values())) + 2
    return "\n".join(f"  {text:<{width}}{docs.get(key, '')}".rstrip() for key, text in shown.items())


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(value: Any) -> str:
    """A value as it is written on the command line (``null``, ``true``, ``[0.9,0.95]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(_show, value)) + "]"
    return str(value)


def key_descriptions() -> dict[str, str]:
    """``"train.steps" -> "optimizer steps"`` for every key of :class:`SysxConfig` (``""`` when a field has no comment)."""
    found: dict[str, str] = {}
    hints = get_type_hints(SysxConfig)
    top = field_comments(SysxConfig)
    for f in dataclasses.fields(SysxConfig):
        section = hints[f.name]
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            docs = field_comments(section)
            found.update({f"{f.name}.{s.name}": docs.get(s.name, "") for s in dataclasses.fields(section)})
        else:
            found[f.name] = top.get(f.name, "")
    return found


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment, over ``cls`` and its dataclass bases (a subclass's comment wins)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass.__module__.startswith("sysx."):  # not object's
            found.update(_comments_in(textwrap.dedent(inspect.getsource(klass))))
    return found


def _comments_in(source: str) -> dict[str, str]:
    """The comments of the annotated assignments in a class body: those on the lines just above a
    field and those on its own (possibly wrapped) line, joined."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.NL]
    found: dict[str, str] = {}
    pending: list[str] = []
    current: str | None = None
    depth, line_start = 0, True
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            depth += 1 if tok.type == tokenize.INDENT else -1
            pending, line_start = [], True
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if current is not None:
                found[current] = f"{found[current]} {text}".strip()
            else:
                pending.append(text)
        elif tok.type == tokenize.NEWLINE:
            if current is None:
                pending = []
            current, line_start = None, True
        else:
            is_field = line_start and depth == 1 and tok.type == tokenize.NAME and tokens[i + 1].string == ":"
            if is_field:
                current = tok.string
                found[current] = " ".join(pending)
                pending = []
            line_start = False
    return found
