"""The next token from the last position's logits: greedy, or temperature with top-p (nucleus), seeded.

Sampling runs on the CPU in fp32 from its own generator, so a seed gives the same tokens on any
device and whatever else draws random numbers.
"""

from __future__ import annotations

import math

import torch

from sysx.generate import GenerateError


def check_sampling(temperature: float, top_p: float) -> None:
    """``temperature >= 0`` (0 is greedy) and ``top_p`` in (0, 1], else a one-line :class:`GenerateError`."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerateError(
            f"--temperature {temperature} must be >= 0 (0 is greedy, 0.7 a common choice); give a number >= 0"
        )
    if not (0 < top_p <= 1):
        raise GenerateError(f"--top-p {top_p} must be in (0, 1] (1 keeps every token, 0.9 a common choice)")


class Sampler:
    """Picks tokens: argmax at temperature 0, else softmax(logits / temperature) cut to the smallest set
    of tokens whose probability reaches ``top_p`` (the most likely one always kept), renormalised."""

    def __init__(self, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        check_sampling(temperature, top_p)
        self.temperature = temperature
        self.top_p = top_p
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def greedy(self) -> bool:
        """True at temperature 0."""
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from ``logits [vocab]``."""
        logits = logits.detach().to("cpu", torch.float32)
        if self.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # probability of the tokens ranked above each
            sorted_probs[before >= self.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
