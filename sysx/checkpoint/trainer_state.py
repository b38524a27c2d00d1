"""The trainer's own state in a checkpoint: random number generators, as JSON.

The data position needs no saving (the sampler is a pure function of the step) and the loss
scaler and step are plain numbers; the random generators are the only opaque state. They are
saved so that anything random added later (dropout, sampling) resumes exactly too.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Python's and torch's generators (CPU, and every CUDA device when present)."""
    state: dict[str, Any] = {
        "python": _encode_python(random.getstate()),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only when the device count matches)."""
    random.setstate(_decode_python(state["python"]))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in cuda])


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _encode_python(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_python(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
