"""Which tokens of a rendered chat are the assistant's: found by rendering prefixes of the conversation.

Most real chat templates (Llama 3, Qwen) have no ``{% generation %}`` tags, so the assistant spans
cannot be asked of the template. They can be measured: for an assistant message ``i``, the render
of ``messages[:i]`` with the generation prompt ends where the answer begins, and the render of
``messages[:i+1]`` ends where the turn ends. Both must be token prefixes of the whole conversation's
render; a template for which they are not (one that rewrites earlier turns, e.g. drops past
reasoning) gives a row of its own bad kind rather than a guessed mask. Within a span, tokens after
the last end-of-turn token (eos, e.g. ``<|im_end|>``) are the template's separator, not the answer:
they are not trained.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sysx.data.sample_tokenizer import SampleTokenizer


class BadRow(Exception):
    """A row that cannot become a sample; ``kind`` names the kind of fault (the report groups by it)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _render(tok: SampleTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
    try:
        return tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja's raise_exception (e.g. "roles must alternate") and template errors
        raise BadRow("template failure") from exc


def chat_sample(tok: SampleTokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], np.ndarray]:
    """Ids of the rendered conversation and its mask: 1 on every assistant turn's tokens (through the
    turn's end token), 0 elsewhere. Raises :class:`BadRow` for a conversation that cannot be masked."""
    ids = _render(tok, messages)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _render(tok, messages[:i], add_generation_prompt=True) if i else []
        turn = _render(tok, messages[: i + 1])
        if not (i and _is_prefix(start, turn) and _is_prefix(turn, ids)):
            raise BadRow("template not prefix-stable" if i else "answer before any prompt")
        span = turn[len(start) :]
        ends = [k for k, t in enumerate(span) if t == tok.eos_id]
        stop = len(start) + (ends[-1] + 1 if ends else len(span))
        mask[len(start) : stop] = 1
    if not mask.any():
        raise BadRow("empty answer")
    return ids, mask
