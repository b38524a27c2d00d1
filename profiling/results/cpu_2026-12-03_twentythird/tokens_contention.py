"""Probe: is the Block's slowdown with both ranks computing larger at the job's micro-batch (1024 tokens)
than at the one sequence (128 tokens) the tuner times it at? Two gloo processes, one thread each;
windows alternate: rank 0 alone (rank 1 waits at the barrier), then both together."""

import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sysx.autotune.contention import block_passes
from sysx.machine.hardware import mean_run_seconds
from sysx.model import get_preset
from sysx.model.llama import init_layer, make_layer


def main(rank, world, sizes, reps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29671")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = get_preset(sys.argv[1] if len(sys.argv) > 1 else "tiny")
    layer = make_layer(cfg, 1, dtype=torch.float32, device=torch.device("cpu"))
    init_layer(layer, 1)
    res = {b: {"alone": [], "together": []} for b in sizes}
    for b in sizes:
        x = torch.randn(b, 128, cfg.dim, generator=torch.Generator().manual_seed(0))

        def step(x=x):
            block_passes(layer, x)

        step()
        step()
        for _r in range(reps):
            dist.barrier()
            if rank == 0:
                res[b]["alone"].append(mean_run_seconds(step, repeats=3, window_s=0.4)[0])
            dist.barrier()
            t = mean_run_seconds(step, repeats=3, window_s=0.4)[0]
            res[b]["together"].append(t)
    if rank == 0:
        for b in sizes:
            a, t = res[b]["alone"], res[b]["together"]
            ratios = [y / x for x, y in zip(a, t)]
            print(
                f"tokens {b * 128:5d}: alone {statistics.median(a) * 1e3:7.2f} ms  together {statistics.median(t) * 1e3:7.2f} ms  "
                f"ratio median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, [1, 2, 4, 8, 16], 6), nprocs=2)
