"""When no candidate fits: the closest one and the changes that would make one fit.

Never just "no configuration found" (users distrust that answer: accelerate#1830,
transformers#27830). Each change is checked, not guessed: more ranks and shorter sequences re-run
the search under the changed job; more GPU or host memory is the least the candidates need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sysx.autotune.profile import MachineProfile
from sysx.autotune.search import RESOURCES, Budget, Candidate, Result, Space, search
from sysx.memory.budget import fmt_bytes

_NAMES = {
    "gpu": "GPU memory per GPU",
    "host": "host memory per node",
    "shm": "/dev/shm per node",
    "disk": "free disk under optim.nvme_dir per node",
}


@dataclass(frozen=True)
class Change:
    """One change that makes a candidate fit: ``kind`` (ranks, gpu, host, shm, seq_len), the value
    it needs, and a sentence."""

    kind: str
    value: float
    text: str


def _least_need(cands: list[Candidate], budget: Budget, resource: str) -> Candidate | None:
    """The candidate needing least of ``resource`` among those within the other budgets (the faster of equals)."""
    others = [c for c in cands if all(c.over[r] <= 1.0 for r in RESOURCES if r != resource)]
    return min(others, key=lambda c: (c.over[resource], c.iteration), default=None)


def _memory_changes(result: Result) -> list[Change]:
    out = []
    for resource in RESOURCES:
        cand = _least_need(result.rejected, result.budget, resource)
        if cand is None or cand.over[resource] <= 1.0:
            continue
        need = cand.over[resource] * getattr(result.budget, resource)
        have = getattr(result.budget, resource)
        out.append(
            Change(
                resource,
                need,
                f"{_NAMES[resource]}: {fmt_bytes(need)} instead of {fmt_bytes(have)} lets `{cand.label()}` fit",
            )
        )
    return out


def _smallest_space(space: Space) -> Space:
    # memory does not depend on the optimizer workers: one setting is enough to ask "does it fit"
    return dataclasses.replace(space, optimizer_workers=(1,))


def _rank_change(result: Result, profile: MachineProfile, space: Space, factors: tuple[int, ...]) -> Change | None:
    job = result.job
    for f in factors:
        # more ranks at the same ranks per node: more nodes, each holding less state
        bigger = dataclasses.replace(job, n_ranks=job.n_ranks * f, gpus_per_node=job.ranks_per_node)
        best = search(bigger, result.budget, profile, _smallest_space(space)).best
        if best is not None:
            return Change(
                "ranks",
                bigger.n_ranks,
                f"{bigger.n_ranks} ranks ({job.ranks_per_node} per node) instead of "
                f"{job.n_ranks}: `{best.label()}` fits",
            )
    return None


def _seq_change(result: Result, profile: MachineProfile, space: Space, min_seq: int) -> Change | None:
    job = result.job
    seq = job.seq_len // 2
    while seq >= min_seq:
        # the profile's layer times scale with the tokens; the memory sizes come from the shape
        shorter = dataclasses.replace(job, seq_len=seq)
        best = search(shorter, result.budget, profile, _smallest_space(space)).best
        if best is not None:
            return Change("seq_len", seq, f"train.seq_len={seq} instead of {job.seq_len}: `{best.label()}` fits")
        seq //= 2
    return None


def advise(
    result: Result,
    profile: MachineProfile,
    space: Space | None = None,
    *,
    rank_factors: tuple[int, ...] = (2, 4, 8),
    min_seq: int = 64,
) -> list[Change]:
    """Changes that make some candidate fit (empty when one already does)."""
    if result.best is not None:
        return []
    space = space or Space()
    changes = _memory_changes(result)
    for found in (_rank_change(result, profile, space, rank_factors), _seq_change(result, profile, space, min_seq)):
        if found is not None:
            changes.append(found)
    return changes
