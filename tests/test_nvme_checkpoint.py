"""Checkpoints from and into the NVMe tier's state files (sysx.checkpoint.streamed, tier_state and
sysx.optim.nvme.stream): the saved layers are bit-identical to a host-memory save of the same state,
a restore writes the state files back bit-identically, and both hold only the staging buffer: no
layer, let alone a stage, is ever in RAM."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

from sysx.checkpoint import Checkpoint, CheckpointSaver
from sysx.checkpoint import saver as saver_mod
from sysx.checkpoint.flat_state import flat_layer_states
from sysx.checkpoint.layer_state import KINDS
from sysx.checkpoint.streamed import layer_index
from sysx.checkpoint.tier_state import restore_flat, tier_layer_sources
from sysx.memory.pinned import PinnedStaging
from sysx.model.flat import FlatLayout
from sysx.optim.nvme import StateDir, aligned_nbytes, open_engine
from sysx.optim.nvme.stream import StateStream

CHUNK = 16 << 10  # far smaller than a layer's state: every tensor crosses several chunks


def _layout(width: int) -> FlatLayout:
    torch.manual_seed(0)
    return FlatLayout.from_modules([nn.Linear(width, 3 * width - 5), nn.Linear(3 * width - 5, width)])


def _state(layout: FlatLayout) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {kind: torch.randn(layout.numel, generator=gen) for kind in KINDS}


@pytest.fixture
def tier(tmp_path: Path):
    """A StateDir and a stream over the threads engine (the same on every machine)."""
    (tmp_path / "nvme").mkdir()
    engine = open_engine("threads", str(tmp_path / "nvme"))
    state_dir = StateDir(str(tmp_path / "nvme"), job="tckpt", node=0, rank=0)
    stream = StateStream(engine, chunk_bytes=CHUNK)
    yield state_dir, engine, stream
    stream.close()
    engine.close()
    state_dir.close()


def _to_files(state_dir: StateDir, engine, flat: dict[str, torch.Tensor]) -> dict[str, str]:
    """m and v into state files (as the tier keeps them); the master stays in RAM (fp32 runs)."""
    paths = state_dir.reserve({k: flat[k].numel() * 4 for k in ("exp_avg", "exp_avg_sq")})
    for kind, path in paths.items():
        staging = PinnedStaging(aligned_nbytes(flat[kind].numel() * 4))
        view = staging.view(torch.float32, staging.nbytes // 4)
        view.zero_()[: flat[kind].numel()].copy_(flat[kind])
        engine.write(path, view).result()
        del view
        staging.close()
    return paths


def _read_file(engine, path: str, numel: int) -> torch.Tensor:
    staging = PinnedStaging(aligned_nbytes(numel * 4))
    view = staging.view(torch.float32, staging.nbytes // 4)
    engine.read(path, view).result()
    out = view[:numel].clone()
    del view
    staging.close()
    return out


def _save(root: Path, sources, step: int = 7) -> Checkpoint:
    saver = CheckpointSaver(root, rank=0, world=1, keep=1, tag="t")
    report = saver.save(step, sources, manifest={"model": {}}, trainer_state={"step": step})
    saver.close()
    assert report.nbytes == sum(s().nbytes for s in sources.values())
    return Checkpoint(root / f"step-{step:08d}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_tier_save_is_bit_identical_to_host_save_and_restores_bit_identically(tmp_path: Path, tier) -> None:
    state_dir, engine, stream = tier
    layout, layers = _layout(24), [4, 5]
    flat = _state(layout)
    host = _save(tmp_path / "host", flat_layer_states(layout, layers, *flat.values(), lambda: 7))
    paths = _to_files(state_dir, engine, flat)
    kinds = {"weight": flat["weight"], **paths}
    streamed_sources = tier_layer_sources(layout, layers, kinds, lambda: 7, stream, chunk_bytes=CHUNK)
    streamed = _save(tmp_path / "tier", streamed_sources)
    for i in layers:
        a, b = host.layer(i), streamed.layer(i)  # decoded with safetensors, checksums checked
        assert a.step == b.step == 7
        for kind in KINDS:
            assert getattr(a, kind).keys() == getattr(b, kind).keys()
            for name, t in getattr(a, kind).items():
                assert torch.equal(_bits(t), _bits(getattr(b, kind)[name])), (i, kind, name)

    # restore the host-memory checkpoint into fresh state files and a fresh master
    fresh = {k: state_dir.file(f"r.{k}") for k in ("exp_avg", "exp_avg_sq")}
    master = torch.full((layout.numel,), float("nan"))
    step = restore_flat(host, layout, layers, {"weight": master, **fresh}, stream, what="test", chunk_bytes=CHUNK)
    assert step == 7 and torch.equal(_bits(master), _bits(flat["weight"]))
    for kind, path in fresh.items():
        assert torch.equal(_bits(_read_file(engine, path, layout.numel)), _bits(flat[kind])), kind


def test_save_and_restore_hold_only_the_staging_buffer(tmp_path: Path, tier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage of ~1.3 MiB per kind through a 16 KiB stream: no whole-layer bytes (encode_layer is
    never called, tracemalloc sees no large buffer) and one staging buffer of chunk + one page."""
    state_dir, engine, stream = tier
    layout, layers = _layout(192), [0, 1]
    flat = _state(layout)
    paths = _to_files(state_dir, engine, flat)
    allocated: list[int] = []
    real_init = PinnedStaging.__init__

    def counting_init(self: PinnedStaging, nbytes: int, **kw: object) -> None:
        allocated.append(nbytes)
        real_init(self, nbytes, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PinnedStaging, "__init__", counting_init)
    monkeypatch.setattr(saver_mod, "encode_layer", lambda state: pytest.fail("a whole layer was encoded in RAM"))
    kinds = {"weight": flat["weight"], **paths}
    layer_bytes = layout.numel * 4 * 3 // 2
    tracemalloc.start()
    try:
        ckpt = _save(
            tmp_path / "ckpt", tier_layer_sources(layout, layers, kinds, lambda: 1, stream, chunk_bytes=CHUNK), 1
        )
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fresh = {k: state_dir.file(f"r.{k}") for k in ("exp_avg", "exp_avg_sq")}
        restore_flat(
            ckpt, layout, layers, {"weight": flat["weight"].clone(), **fresh}, stream, what="t", chunk_bytes=CHUNK
        )
        _, restore_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert allocated == []  # the stream's one buffer was made before; nothing else
    assert stream.staging_bytes == 2 * (CHUNK + 4096)
    assert save_peak < 4 * CHUNK and restore_peak < 4 * CHUNK, (save_peak, restore_peak, layer_bytes)
    for kind, path in fresh.items():
        assert torch.equal(_bits(_read_file(engine, path, layout.numel)), _bits(flat[kind]))


def test_restore_refuses_a_mismatched_checkpoint(tmp_path: Path, tier) -> None:
    state_dir, _, stream = tier
    layout, layers = _layout(24), [4, 5]
    flat = _state(layout)
    ckpt = _save(tmp_path / "c", flat_layer_states(layout, layers, *flat.values(), lambda: 7))
    other = _layout(16)
    kinds = {"weight": torch.empty(other.numel), "exp_avg": state_dir.file("m"), "exp_avg_sq": state_dir.file("v")}
    with pytest.raises(ValueError, match=r"ckpt X: weight/layers.4.weight is torch.float32 \(67, 24\), this model"):
        restore_flat(ckpt, other, layers, kinds, stream, what="ckpt X")
    entries, metadata = layer_index(ckpt.path / "layer-00004.safetensors")
    assert metadata == {"layer": "4", "step": "7"} and entries["weight/layers.4.bias"].shape == (67,)
