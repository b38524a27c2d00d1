"""Meeting rounds ended three ways, interleaved round by round, 2+ gloo ranks on this CPU (issue 27,
twenty-fourth session): A one all-reduce (the tuner's meeting rounds); B a barrier and two
all-reduces (a replicated step end's three collectives: the replicas' reduction barrier, VALIDATE's
all-reduce, the end's); C as B with a hand-off to a worker thread before each collective (the
optimizer lane's jobs). Per variant, the median over rounds of the ranks' mean (wall - own compute).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 meeting_shapes.py 40
"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from sysx.autotune.contention import block_passes
from sysx.model import get_preset
from sysx.model.llama import init_layer, make_layer


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = get_preset("tiny")
    layer = make_layer(cfg, 1)
    init_layer(layer, 1)
    x = torch.randn(1, 128, cfg.dim, generator=torch.Generator().manual_seed(0))
    pool = ThreadPoolExecutor(1)
    t = torch.zeros(1, dtype=torch.float64)

    def all_reduce() -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    def handoff() -> None:
        pool.submit(lambda: torch.ones(64).sum()).result()

    ends = {
        "A": [all_reduce],
        "B": [dist.barrier, all_reduce, all_reduce],
        "C": [handoff, dist.barrier, handoff, all_reduce, handoff, all_reduce],
    }
    block_passes(layer, x)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.3:
        block_passes(layer, x)
        n += 1
    per = torch.tensor([0.1 / ((time.perf_counter() - t0) / n)])  # passes in 0.1 s, the slowest rank's
    dist.all_reduce(per, op=dist.ReduceOp.MIN)
    per_round, rounds = max(1, int(per.item())), int(sys.argv[1])
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in ends}
    all_reduce()
    for _ in range(rounds):
        for k, end in ends.items():
            a = time.perf_counter()
            for _ in range(per_round):
                block_passes(layer, x)
            b = time.perf_counter()
            for f in end:
                f()
            res[k].append((b - a, time.perf_counter() - a))
    every: list[dict[str, list[tuple[float, float]]]] = [{}] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        print(f"{world} ranks, {per_round} Block passes a round, {rounds} rounds a variant")
        for k in ends:
            met = [
                statistics.fmean(e[k][i][1] for e in every) - statistics.fmean(e[k][i][0] for e in every)
                for i in range(rounds)
            ]
            q1, _, q3 = statistics.quantiles(met, n=4)
            compute = statistics.median(statistics.fmean(e[k][i][0] for e in every) for i in range(rounds))
            print(
                f"{k}: meeting median {statistics.median(met) * 1e3:.2f} ms  (q1 {q1 * 1e3:.2f}, q3 {q3 * 1e3:.2f})"
                f"  compute {compute * 1e3:.1f} ms"
            )
    dist.destroy_process_group()
    pool.shutdown()


if __name__ == "__main__":
    main()
