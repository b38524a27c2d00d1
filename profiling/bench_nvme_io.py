"""Read and write bandwidth of the NVMe tier's I/O engines, per engine and request size.

    python profiling/bench_nvme_io.py --dir /path/on/nvme [--mib 512] [--rounds 2] [--json out.jsonl]

Each cell is :func:`sysx.optim.nvme.measure_disk` (write ``--mib`` MiB in requests of the given
size, 4 in flight, fsync, then read them back) in a directory of ``--dir``. Engines alternate
inside each round so that load from other processes hits both alike; the table shows the best
round (the least disturbed) and the load average at the start. ``aio`` is skipped with the reason
when DeepSpeed's async_io op is unusable here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from sysx.optim.nvme import measure_disk
from sysx.optim.nvme.aio import unavailable_reason

MiB = 1 << 20
GB = 1e9


def machine_line() -> str:
    """CPU model, core count and the 1-minute load average (:func:`sysx.optim.bench_modes.machine`)."""
    from sysx.optim.bench_modes import machine

    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def main(argv: list[str]) -> int:
    """Run the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--mib", type=int, default=512, help="MiB written and read per cell")
    parser.add_argument("--sizes", default="1,8,32,128", help="request sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="append one JSON line per measurement to this file")
    args = parser.parse_args(argv)
    engines = ["threads"]
    why = unavailable_reason()
    if why is None:
        engines.append("aio")
    else:
        print(f"aio skipped: {why}")
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"machine: {machine_line()}; directory {args.dir}; {args.mib} MiB per cell, 4 requests in flight")
    best: dict[tuple[str, int], tuple[float, float, bool]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sysx-bench-nvme-") as work:
        for round_ in range(args.rounds):
            for size in sizes:
                for engine in engines if round_ % 2 == 0 else engines[::-1]:
                    p = measure_disk(work, args.mib * MiB, engine=engine, request_bytes=size * MiB)
                    row = {
                        "engine": p.engine,
                        "request_mib": size,
                        "read_GBps": p.read_Bps / GB,
                        "write_GBps": p.write_Bps / GB,
                        "direct": p.direct,
                        "round": round_,
                        "load1": os.getloadavg()[0],
                        "unix": time.time(),
                    }
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
                    old = best.get((engine, size), (0.0, 0.0, p.direct))
                    best[(engine, size)] = (max(old[0], row["read_GBps"]), max(old[1], row["write_GBps"]), p.direct)
    print("\n| engine | request | read GB/s | write GB/s | O_DIRECT |")
    print("| --- | ---: | ---: | ---: | --- |")
    for (engine, size), (read, write, direct) in best.items():
        print(f"| {engine} | {size} MiB | {read:.2f} | {write:.2f} | {'yes' if direct else 'no (buffered)'} |")
    print(f"\nload at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
