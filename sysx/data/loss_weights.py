"""How a step's loss pieces add up to the step's loss: the mean over the trained tokens of its global batch.

A piece (a micro-batch, or a chunk of its rows) computes the mean cross-entropy over its own trained
tokens (labels != -100). With a loss mask those counts differ from piece to piece, and the mean of the
pieces' means would weigh a token of a short answer more than one of a long answer (the gradient-
accumulation error transformers#34191 fixed with ``num_items_in_batch``). So each piece counts
``weight / total`` of the step: its trained tokens over the global batch's (every micro-batch of every
replica, known up front from the data: :func:`sysx.data.sampler.step_trained_tokens`). Without a loss
mask every piece weighs 1 and ``total`` is the number of pieces: the plain ``loss / n`` of before, bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sysx.data.sampler import step_trained_tokens
from sysx.model.loss import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from sysx.data.dataset import TokenDataset


@dataclass(frozen=True)
class LossWeights:
    """The weights of one step's loss pieces (see the module docstring)."""

    total: float  # the pieces' weights summed over the step (every replica's)
    per_token: bool  # a piece weighs its trained tokens (a loss-masked dataset); else 1

    @classmethod
    def of_step(
        cls,
        dataset: TokenDataset,
        *,
        pieces: int,
        seed: int,
        step: int,
        rows_per_step: int,
        seq_len: int,
        split: str = "train",
    ) -> LossWeights:
        """The weights of ``step``'s ``pieces`` loss pieces (every replica's); reads only the data's loss mask."""
        trained = step_trained_tokens(
            dataset, seed=seed, step=step, rows_per_step=rows_per_step, seq_len=seq_len, split=split
        )
        return cls(float(pieces), False) if trained is None else cls(float(trained), True)

    def weight(self, labels: torch.Tensor) -> float:
        """A piece's weight: its trained tokens, or 1. Give the host copy of ``labels`` (no device sync)."""
        return float((labels != IGNORE_INDEX).sum()) if self.per_token else 1.0

    def divisor(self, weight: float) -> float:
        """What the piece's mean loss is divided by for the step's gradient: ``total / weight`` (the
        number of pieces without a mask). A piece without trained tokens has loss 0 whatever it is."""
        return self.total / weight if weight else 1.0


def weighted_mean(losses: list[float], weights: list[float]) -> float:
    """The step's (or an evaluation's) loss from its pieces' mean losses and weights."""
    return sum(loss * w for loss, w in zip(losses, weights)) / sum(weights)
