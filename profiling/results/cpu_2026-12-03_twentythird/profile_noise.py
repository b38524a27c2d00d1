"""Probe: how much the tuner's profile inputs move from one measurement to the next (tiny, seq 128, 1 thread),
beside the Block timed as the together measurement times it (one rank: alone), interleaved."""

import statistics
import sys
import time

import torch

from sysx.autotune.contention import time_block_together
from sysx.autotune.profile import measure_profile
from sysx.model import get_preset
from sysx.optim.cores import intra_op_threads

cfg = get_preset("tiny")
rows = []
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    with intra_op_threads(1):
        t0 = time.perf_counter()
        p = measure_profile(cfg, 128, [1, 2, 4, 8, 16], dtype=torch.float32, device="cpu", adam_backend="torch")
        t1 = time.perf_counter()
        tog = time_block_together(cfg, 128, torch.float32)
    b = p.layer_time("block", 128)
    h = p.layer_time("head", 512)
    e = p.layer_time("embedding", 512)
    b4 = p.layer_time("block", 512)
    hw = p.hardware
    row = dict(
        block128=sum(b) * 1e3,
        block512=sum(b4) * 1e3,
        head512=sum(h) * 1e3,
        emb512=sum(e) * 1e3,
        together128=tog.wall * 1e3,
        ratio=tog.wall / sum(b),
        op_host_us=hw.op_host_s * 1e6,
        adam_Mps=p.adam_params_per_s / 1e6,
        job_Mps=(p.optim_job_params_per_s or 0) / 1e6,
        matmul_G=hw.matmul_flops_per_s / 1e9,
        mem_GBps=hw.device_mem_bytes_per_s / 1e9,
        prof_s=t1 - t0,
    )
    rows.append(row)
    print(i, " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
for k in rows[0]:
    xs = [r[k] for r in rows]
    print(f"{k:12s} min {min(xs):9.3f} max {max(xs):9.3f} cv {statistics.pstdev(xs) / statistics.fmean(xs):.3f}")
