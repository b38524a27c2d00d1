"""When a CPU optimizer step may run before its validation: ``optim.speculate=auto|always|never``.

:class:`SpeculationPolicy` decides per step: ``auto`` speculates while recent steps were clean (no
overflow, clip coefficient 1) and, after a vetoed one, validates first until ``optim.speculate_after``
(:data:`SPECULATE_AFTER`) clean steps passed; when nothing can veto a step it always speculates.
Every rank feeds it the same globally reduced outcome, so all decide alike without a message.
"""

from __future__ import annotations

from dataclasses import dataclass

# SPECULATE_AFTER: clean steps after a vetoed one before ``auto`` speculates again. A mispredicted
# speculation costs an undo and a step (undo is ~8x a step with optim.rollback=undo), validating
# first one exposed step, so speculation pays only when a veto is rare: after a veto the next few
# steps are likely vetoed too (the norm drifts slowly), hence more than one clean step first.
from sysx.config.choices import SPECULATE_AFTER, SPECULATE_MODES

__all__ = ["SPECULATE_AFTER", "SPECULATE_MODES", "SpeculationPolicy"]


@dataclass
class SpeculationPolicy:
    """The speculation state machine (see docs/architecture.md); pure, no torch."""

    mode: str = "auto"
    after: int = SPECULATE_AFTER  # clean steps after a vetoed one before auto speculates again
    can_veto: bool = True  # clipping on or fp16 loss scaling: a step can be vetoed
    clean_run: int = -1  # clean steps since the last vetoed one (-1: none vetoed yet)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE_MODES:
            raise ValueError(f"optim.speculate={self.mode!r} is not valid; allowed: {', '.join(SPECULATE_MODES)}")
        if self.after < 0:
            raise ValueError(f"optim.speculate_after={self.after} must be >= 0 (clean steps before speculating again)")

    def speculate(self) -> bool:
        """Whether the next step steps before its validation."""
        if self.mode != "auto":
            return self.mode == "always"
        return not self.can_veto or self.clean_run < 0 or self.clean_run >= self.after

    def record(self, *, clean: bool) -> None:
        """The validation of the step just taken said it was ``clean`` (no overflow, not clipped)."""
        self.clean_run = (self.clean_run + 1 if self.clean_run >= 0 else -1) if clean else 0

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps, so a resumed run decides as the uninterrupted one would."""
        return {"clean_run": self.clean_run}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s state."""
        self.clean_run = int(state["clean_run"])


def window_mode(overlap: str, speculate: str) -> str:
    """The sliding window's speculation mode from ``single.optimizer_overlap`` (``backward`` =
    always, ``forward`` = never, ``auto`` = ``optim.speculate``) and ``optim.speculate``; two
    explicit settings that disagree are an error naming both."""
    spelled = {"backward": "always", "forward": "never"}.get(overlap)
    if spelled is None:
        return speculate
    if speculate not in ("auto", spelled):
        raise ValueError(
            f"single.optimizer_overlap={overlap} means optim.speculate={spelled}, but optim.speculate="
            f"{speculate}; set one of them only (single.optimizer_overlap=auto defers to optim.speculate)"
        )
    return spelled
