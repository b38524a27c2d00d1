"""Checkpoint save and restore of one stage's optimizer state: host memory vs the NVMe tier's files.

    python profiling/bench_nvme_checkpoint.py --dir /path/on/nvme [--mparams 100] [--layers 4] [--rounds 2]

A stage of ``--mparams`` million fp32 parameters in ``--layers`` layers: the host-memory way
(``flat_layer_states`` -> ``encode_layer``, a whole layer's bytes in RAM; restore via
``Checkpoint.layer`` + ``load_flat``) against the tier's (m and v in state files, the master in RAM;
``tier_layer_sources`` streamed through a ``StateStream``; ``restore_flat`` back into the files).
Both write synchronously into a checkpoint folder under ``--dir``; the two ways alternate within a
round. The table shows GB/s of state (3 x 4 bytes per parameter) and the extra host memory each way
holds at its peak: one layer's state and its encoded bytes, or the stream's staging buffer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from sysx.checkpoint import Checkpoint, CheckpointSaver
from sysx.checkpoint.flat_state import flat_layer_states, load_flat
from sysx.checkpoint.tier_state import restore_flat, tier_layer_sources
from sysx.memory.pinned import PinnedStaging
from sysx.model.flat import FlatEntry, FlatLayout
from sysx.optim.nvme import StateDir, aligned_nbytes, open_engine
from sysx.optim.nvme.stream import StateStream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_nvme_io import machine_line

GB = 1e9


def _layout(mparams: int, layers: int) -> FlatLayout:
    per = mparams * 1_000_000 // layers
    return FlatLayout([FlatEntry(f"{i}.w", (per,), i * per, per) for i in range(layers)], torch.float32)


def _save(root: Path, step: int, sources: dict) -> float:
    t0 = time.perf_counter()
    saver = CheckpointSaver(root, rank=0, world=1, keep=1, tag="bench")
    saver.save(step, sources, manifest={"model": {}}, trainer_state={}, background=False)
    saver.close()
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    """Run the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--mparams", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", default="threads")
    args = parser.parse_args(argv)
    layout, layers = _layout(args.mparams, args.layers), list(range(args.layers))
    state_bytes = layout.numel * 12
    print(f"machine: {machine_line()}; {args.mparams}M parameters in {args.layers} layers, engine {args.engine}")
    gen = torch.Generator().manual_seed(0)
    flat = {k: torch.randn(layout.numel, generator=gen) for k in ("weight", "exp_avg", "exp_avg_sq")}
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sysx-bench-ckpt-") as work:
        engine = open_engine(args.engine, work)
        state_dir = StateDir(work, job="benchckpt", node=0, rank=0)
        stream = StateStream(engine)
        paths = state_dir.reserve({k: layout.numel * 4 for k in ("exp_avg", "exp_avg_sq")})
        for kind, path in paths.items():
            staging = PinnedStaging(aligned_nbytes(layout.numel * 4))
            view = staging.view(torch.float32, staging.nbytes // 4)
            view[: layout.numel].copy_(flat[kind])
            engine.write(path, view).result()
            del view
            staging.close()
        kinds = {"weight": flat["weight"], **paths}
        for round_ in range(args.rounds):
            for way in ("host", "tier") if round_ % 2 == 0 else ("tier", "host"):
                root = Path(work) / f"ckpt-{way}"
                if way == "host":
                    sources = flat_layer_states(layout, layers, *flat.values(), lambda: 1)
                else:
                    sources = tier_layer_sources(layout, layers, kinds, lambda: 1, stream)
                save_s = _save(root, round_ + 1, sources)
                ckpt = Checkpoint(root / f"step-{round_ + 1:08d}")
                t0 = time.perf_counter()
                if way == "host":
                    out = torch.empty(layout.numel)
                    for field in ("weight", "exp_avg", "exp_avg_sq"):
                        load_flat(layout, layers, {i: getattr(ckpt.layer(i), field) for i in layers}, out, what="b")
                else:
                    fresh = {k: state_dir.file(f"r.{k}") for k in paths}
                    restore_flat(ckpt, layout, layers, {"weight": torch.empty(layout.numel), **fresh}, stream, what="b")
                restore_s = time.perf_counter() - t0
                shutil.rmtree(root)
                for key, seconds in ((f"{way} save", save_s), (f"{way} restore", restore_s)):
                    best[key] = min(best.get(key, float("inf")), seconds)
        stream_bytes = stream.staging_bytes
        stream.close()
        engine.close()
        state_dir.close()
    layer_bytes = state_bytes // args.layers
    print("\n| way | save GB/s | restore GB/s | extra host memory at peak |")
    print("| --- | ---: | ---: | ---: |")
    for way, extra in (("host", 2 * layer_bytes), ("tier", stream_bytes)):
        save, restore = state_bytes / best[f"{way} save"] / GB, state_bytes / best[f"{way} restore"] / GB
        print(f"| {way} | {save:.2f} | {restore:.2f} | {extra / 2**20:.0f} MiB |")
    print(f"\nload at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
