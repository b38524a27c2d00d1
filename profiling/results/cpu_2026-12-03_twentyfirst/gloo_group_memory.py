"""Anonymous memory a rank gains from N more gloo groups of all ranks (each used once) and from a
thread (issue 27, twenty-first session: what the replicas' groups add past a rank's baseline).

    for r in 0 1; do MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 RANK=$r WORLD_SIZE=2 \\
      python profiling/results/cpu_2026-12-03_twentyfirst/gloo_group_memory.py 2 & done; wait
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def anon_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def main(n_groups: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.all_reduce(torch.ones(8))
    dist.barrier()
    before = anon_mib()
    groups = [dist.new_group(list(range(world)), backend="gloo") for _ in range(n_groups)]
    for group in groups:
        dist.barrier(group=group)
        dist.reduce(torch.ones(1000), dst=0, group=group)
    with_groups = anon_mib()
    thread = threading.Thread(target=time.sleep, args=(0.5,))
    thread.start()
    with_thread = anon_mib()
    thread.join()
    print(
        f"rank {rank}: {n_groups} gloo groups +{with_groups - before:.1f} MiB anon, "
        f"a thread +{with_thread - with_groups:.1f} MiB",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
