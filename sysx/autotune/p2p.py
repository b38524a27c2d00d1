"""p2p bandwidth and latency between the job's ranks, measured at tune time (collective).

Rank 0 plays ping-pong with one peer on its own node (intra-node) and, when the job spans nodes,
with the first rank of the next node (inter-node), over the job's process group and on its device
(the links and backend the pipeline's messages take). A message of ``n`` bytes is taken to cost
``latency + n / bandwidth`` one way: the latency is the one-way time (half the fastest round
trip) of a message of a few bytes, the bandwidth the slope of the least-squares line through the
one-way times of a few large sizes. The other ranks wait at the barrier that ends it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as tdist

SIZES = (4 << 10, 1 << 20, 4 << 20)  # bytes: the line through them gives the bandwidth
TINY = 16  # bytes: a message this small costs the per-message latency alone
ROUNDS = 3  # round trips a size is timed over (the fastest kept), after one that connects the pair
# the tiny message's: its fastest of 3 read 53-116 us between four ranks on two cores (once 1983 us,
# which a tiny:4 plan charged to every all-reduce: 12% too slow); of 30, 41-63 us, for 6 ms more (issue 27)
TINY_ROUNDS = 30


@dataclass(frozen=True)
class P2PFigures:
    """One-way p2p figures (bytes/s, seconds); ``inter_*`` None when the job is on one node."""

    ranks: int
    ranks_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float | None = None
    inter_latency: float | None = None

    def costs_fields(self) -> dict[str, float]:
        """The :class:`~sysx.schedule.costs.Costs` fields these figures set."""
        out = {"p2p_bandwidth": self.intra_bandwidth, "p2p_latency": self.intra_latency}
        if self.inter_bandwidth is not None and self.inter_latency is not None:
            out.update(inter_p2p_bandwidth=self.inter_bandwidth, inter_p2p_latency=self.inter_latency)
        return out

    def as_dict(self) -> dict[str, float | None]:
        """Plain fields (for the cached profile's JSON)."""
        return asdict(self)

    def describe(self) -> str:
        """``p2p 1.2 GB/s + 35 us in a node, 0.9 GB/s + 60 us between nodes``."""
        line = f"p2p {self.intra_bandwidth / 1e9:.3g} GB/s + {self.intra_latency * 1e6:.0f} us in a node"
        if self.inter_bandwidth is not None and self.inter_latency is not None:
            line += f", {self.inter_bandwidth / 1e9:.3g} GB/s + {self.inter_latency * 1e6:.0f} us between nodes"
        return line


def fit_line(sizes: list[float], seconds: list[float], tiny: float | None = None) -> tuple[float, float]:
    """``(bandwidth, latency)`` of the least-squares line ``seconds = latency + size / bandwidth``
    (latency clamped at 0; a flat or falling line, pure noise, gives an infinite-looking bandwidth of 1e15).
    With ``tiny`` (the one-way seconds of a message of a few bytes) the latency is that time, the
    per-message cost a fine layout pays thousands of times a step, and the bandwidth the slope of
    the sizes alone: a line through large messages says little about its intercept."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx if sxx > 0 else 0.0
    latency = max(0.0, my - slope * mx) if tiny is None else tiny
    return (1.0 / slope if slope > 0 else 1e15), latency


def _ping_pong(
    peer: int, first: bool, device: torch.device, group: tdist.ProcessGroup | None, sizes: tuple[int, ...] = SIZES
) -> list[float]:
    """One-way seconds per size (half the fastest round trip, of :data:`TINY_ROUNDS` for a message
    of :data:`TINY` bytes or fewer, else of :data:`ROUNDS`); ``first`` sends first."""
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        best = float("inf")
        rounds = TINY_ROUNDS if size <= TINY else ROUNDS
        for i in range(rounds + 1):  # the first round trip connects the pair: not timed
            t0 = time.perf_counter()
            if first:
                tdist.send(buf, peer, group=group)
                tdist.recv(buf, peer, group=group)
            else:
                tdist.recv(buf, peer, group=group)
                tdist.send(buf, peer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i > 0:
                best = min(best, time.perf_counter() - t0)
        out.append(best / 2)
    return out


def measure_p2p(
    rank: int, world: int, ranks_per_node: int, device: torch.device, group: tdist.ProcessGroup | None = None
) -> P2PFigures | None:
    """Collective over ``group`` (every rank calls it): the figures on rank 0, None elsewhere and
    for a one-rank job."""
    if world < 2:
        return None
    per_node = max(1, min(ranks_per_node, world))
    pairs = []  # (peer of rank 0, kind)
    if per_node > 1:
        pairs.append((1, "intra"))
    if world > per_node:
        pairs.append((per_node, "inter"))
    found: dict[str, tuple[float, float]] = {}
    for peer, kind in pairs:
        if rank == 0:
            times = _ping_pong(peer, True, device, group, (TINY, *SIZES))
            found[kind] = fit_line([float(s) for s in SIZES], times[1:], tiny=times[0])
        elif rank == peer:
            _ping_pong(0, False, device, group, (TINY, *SIZES))
    tdist.barrier(group=group)
    if rank != 0:
        return None
    intra = found.get("intra") or found["inter"]  # one rank per node: the only link there is
    inter = found.get("inter")
    return P2PFigures(
        ranks=world,
        ranks_per_node=per_node,
        intra_bandwidth=intra[0],
        intra_latency=intra[1],
        inter_bandwidth=inter[0] if inter else None,
        inter_latency=inter[1] if inter else None,
    )
