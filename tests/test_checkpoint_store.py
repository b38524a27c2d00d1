"""The checkpoint folder on its own: round trips, commit protocol, latest pointer, rotation, and a
save killed with SIGKILL while a layer file is being written."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from sysx.checkpoint import Checkpoint, CheckpointDir, CheckpointError, CheckpointSaver, LayerState, find_resume
from sysx.checkpoint.store import LATEST, layer_filename


def layer(i: int, numel: int = 64, seed: int = 0) -> LayerState:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    names = [f"layers.{i}.a", f"layers.{i}.b"]
    flat = torch.randn(3, 2 * numel, generator=g)  # views of one flat buffer, as the optimizers hold them
    parts = [
        {n: flat[k, j * numel : (j + 1) * numel].view(8, numel // 8) for j, n in enumerate(names)} for k in range(3)
    ]
    return LayerState(i, parts[0], parts[1], parts[2], step=7 + seed)


def sources(states: dict[int, LayerState]) -> dict:
    return {i: (lambda s=s: s) for i, s in states.items()}


def assert_same(a: LayerState, b: LayerState) -> None:
    assert a.layer == b.layer and a.step == b.step
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        x, y = getattr(a, kind), getattr(b, kind)
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), (kind, name)


@pytest.mark.parametrize("background", [True, False])
def test_round_trip_is_bit_exact_and_files_are_group_readable(tmp_path: Path, background: bool) -> None:
    states = {i: layer(i) for i in range(4)}
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=2, tag="job")
    report = saver.save(
        3, sources(states), manifest={"model": {"n_layers": 2}}, trainer_state={"step": 3}, background=background
    )
    assert report.mode == ("background" if background else "sync") and report.nbytes == 4 * 3 * 128 * 4
    saver.close()
    ckpt = find_resume("auto", tmp_path)
    assert ckpt is not None and ckpt.step == 3 and ckpt.model == {"n_layers": 2} and ckpt.trainer_state() == {"step": 3}
    for i, s in states.items():
        assert_same(ckpt.layer(i), s)
    assert stat.S_IMODE(os.stat(ckpt.path / layer_filename(0)).st_mode) == 0o640
    assert (tmp_path / LATEST).read_text().strip() == "step-00000003"


def test_background_save_copies_the_state_before_training_changes_it(tmp_path: Path) -> None:
    states = {0: layer(0)}
    expected = states[0].snapshot()
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=1, tag="job")
    saver.save(1, sources(states), background=True)
    for t in states[0].weight.values():
        t.add_(1.0)  # the next optimizer step, while the thread writes
    saver.close()
    assert_same(Checkpoint(tmp_path / "step-00000001").layer(0), expected)


def test_no_room_for_a_snapshot_writes_synchronously(tmp_path: Path) -> None:
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=1, tag="job", available_bytes=lambda: 0)
    assert saver.save(1, sources({0: layer(0)})).mode == "sync"
    saver.close()


def test_two_ranks_write_their_own_layers_and_rank0_commits(tmp_path: Path) -> None:
    states = {i: layer(i) for i in range(6)}
    owned = {0: [0, 2, 4], 1: [1, 3, 5]}  # layers by owner, as an interleaved pipeline places them
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            saver = CheckpointSaver(tmp_path, rank=r, world=2, keep=2, tag="job", commit_timeout_s=30)
            saver.save(5, sources({i: states[i] for i in owned[r]}), manifest={"model": {}}, trainer_state={"r": r})
            saver.close()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    ckpt = find_resume("auto", tmp_path)
    assert ckpt is not None and ckpt.trainer_state() == {"r": 0}
    assert sorted(f["rank"] for n, f in ckpt.manifest["files"].items() if n.startswith("layer-")) == [0, 0, 0, 1, 1, 1]
    for i in range(6):
        assert_same(ckpt.layer(i), states[i])
    assert not list(ckpt.path.glob("rank-*.done.json"))


def test_latest_moves_last_and_only_the_newest_keep_remain(tmp_path: Path) -> None:
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=2, tag="job")
    for step in (10, 20, 30):
        saver.save(step, sources({0: layer(0, seed=step)}))
    saver.close()
    assert [p.name for p in CheckpointDir(tmp_path).complete()] == ["step-00000020", "step-00000030"]
    assert find_resume("auto", tmp_path).step == 30  # type: ignore[union-attr]
    (tmp_path / LATEST).write_text("step-00000099\n")  # a pointer to nothing falls back to the newest complete one
    assert CheckpointDir(tmp_path).latest() == tmp_path / "step-00000030"


def test_resume_choices(tmp_path: Path) -> None:
    assert find_resume("auto", tmp_path / "none-yet") is None
    assert find_resume("none", tmp_path) is None
    with pytest.raises(CheckpointError, match="train.resume=.*no such file"):
        find_resume(str(tmp_path / "missing"), tmp_path)
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=1, tag="job")
    saver.save(4, sources({0: layer(0)}))
    saver.close()
    assert find_resume(str(tmp_path), "elsewhere").step == 4  # type: ignore[union-attr]
    assert find_resume(str(tmp_path / "step-00000004"), "elsewhere").step == 4  # type: ignore[union-attr]


def test_a_damaged_file_is_refused_with_its_name(tmp_path: Path) -> None:
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=1, tag="job")
    saver.save(1, sources({0: layer(0)}))
    saver.close()
    path = tmp_path / "step-00000001" / layer_filename(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layer-00000.safetensors: size or checksum differs"):
        Checkpoint(tmp_path / "step-00000001").layer(0)


def test_a_rank_that_never_finishes_fails_the_commit_and_keeps_the_previous(tmp_path: Path) -> None:
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=2, tag="job")
    saver.save(1, sources({0: layer(0)}))
    saver.close()
    lonely = CheckpointSaver(tmp_path, rank=0, world=2, keep=2, tag="job2", commit_timeout_s=0.3)
    with pytest.raises(CheckpointError, match="rank 1 did not finish"):
        lonely.save(2, sources({0: layer(0)}), background=False)
    lonely.close()
    assert CheckpointDir(tmp_path).latest() == tmp_path / "step-00000001"


KILL_CHILD = textwrap.dedent("""
    import sys, torch
    from sysx.checkpoint import CheckpointSaver, LayerState
    root, world = sys.argv[1], int(sys.argv[2])
    def big(i, seed):
        t = torch.full((1 << 20,), float(seed))
        return LayerState(i, {f"layers.{i}.w": t}, {f"layers.{i}.w": t.clone()}, {f"layers.{i}.w": t.clone()}, seed)
    if world == 1:
        saver = CheckpointSaver(root, rank=0, world=1, keep=2, tag="kill")
        saver.save(1, {i: (lambda i=i: big(i, 1)) for i in range(2)}, background=False)
        print("first saved", flush=True)
    # rank `world - 1` of the second save; killed while it writes its layers
    saver = CheckpointSaver(root, rank=world - 1, world=world, keep=2, tag="kill2")
    print("second started", flush=True)
    saver.save(2, {i: (lambda i=i: big(i, 2)) for i in range(2, 400)}, background=False)
    print("second saved", flush=True)
""")


def _kill_while_writing(root: Path, world: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(root), str(world)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        if world == 1:
            assert proc.stdout.readline().strip() == "first saved"
        assert proc.stdout.readline().strip() == "second started"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill while the second save's layer files are being written
            partial = [p for p in root.glob("step-00000002.partial-*") if len(list(p.glob("layer-*"))) >= 2]
            if partial:
                break
            time.sleep(0.01)
        assert partial, "the second save never started writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, world: int) -> None:
    """world 1: the only writer is killed. world 2: rank 1 is killed while it writes its layers; rank 0
    writes its own, then its commit gives up on rank 1 and the previous checkpoint stays the latest."""
    root = tmp_path / "ckpt"
    if world == 2:
        first = CheckpointSaver(root, rank=0, world=1, keep=2, tag="first")
        first.save(
            1,
            {
                i: (
                    lambda i=i: LayerState(
                        i,
                        {f"layers.{i}.w": torch.ones(8)},
                        {f"layers.{i}.w": torch.ones(8)},
                        {f"layers.{i}.w": torch.ones(8)},
                        1,
                    )
                )
                for i in range(2)
            },
        )
        first.close()
    _kill_while_writing(root, world)
    if world == 2:
        rank0 = CheckpointSaver(root, rank=0, world=2, keep=2, tag="kill2", commit_timeout_s=1.0)
        with pytest.raises(CheckpointError, match="rank 1 did not finish"):
            rank0.save(2, sources({0: layer(0), 1: layer(1)}), background=False)
        rank0.close()
    ckpt = find_resume("auto", root)
    assert ckpt is not None and ckpt.step == 1
    assert float(ckpt.layer(1).weight["layers.1.w"][0]) == 1.0
    assert list(root.glob("step-00000002.partial-*"))  # the killed save's folder, ignored by readers
    saver = CheckpointSaver(root, rank=0, world=1, keep=2, tag="after")  # the next save cleans the partial folder
    saver.save(3, sources({0: layer(0)}))
    saver.close()
    assert not list(root.glob("*.partial-*"))
    assert [p.name for p in CheckpointDir(root).complete()] == ["step-00000001", "step-00000003"]
    assert json.loads((root / "step-00000003" / "manifest.json").read_text())["step"] == 3


def test_flat_buffers_round_trip_through_layer_states(tmp_path: Path) -> None:
    from sysx.checkpoint.flat_state import flat_layer_states, load_flat
    from sysx.model import FlatLayout
    from sysx.model.config import ModelConfig
    from sysx.model.llama import make_layer

    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16)
    layout = FlatLayout.from_modules([make_layer(cfg, i) for i in (1, 2)])  # a unit of two blocks
    bufs = [torch.randn(layout.numel) for _ in range(3)]
    sources = flat_layer_states(layout, (1, 2), *bufs, step=lambda: 9)
    assert sorted(sources) == [1, 2] and sources[2]().step == 9
    saver = CheckpointSaver(tmp_path, rank=0, world=1, keep=1, tag="t")
    saver.save(1, sources)
    saver.close()
    ckpt = find_resume("auto", tmp_path)
    assert ckpt is not None
    # Regroup: each block in a layout of its own, as the sliding window holds them.
    for k, index in enumerate((1, 2)):
        alone = FlatLayout.from_modules([make_layer(cfg, index)])
        got = torch.empty(alone.numel)
        load_flat(alone, (index,), {index: ckpt.layer(index).exp_avg}, got, what="test")
        lo = k * alone.numel
        assert torch.equal(got, bufs[1][lo : lo + alone.numel])
    with pytest.raises(ValueError, match="test: layers.1.attn_norm.weight is missing"):
        load_flat(alone, (1,), {1: {}}, got, what="test")


def test_rng_state_round_trip() -> None:
    import random as pyrandom

    from sysx.checkpoint.trainer_state import rng_state, set_rng_state

    state = json.loads(json.dumps(rng_state()))
    a = (torch.rand(3), pyrandom.random())
    set_rng_state(state)
    b = (torch.rand(3), pyrandom.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_rank0_stops_waiting_for_a_rank_that_is_gone(tmp_path: Path) -> None:
    """A rank that died before writing its layers never will: the commit stops at the peer check
    (a dead rank, in a job), not after commit_timeout_s; the job ending on an error keeps its own."""

    def rank1_is_gone() -> None:
        raise RuntimeError("rank 1 died")

    saver = CheckpointSaver(
        tmp_path, rank=0, world=2, keep=2, tag="job", commit_timeout_s=600, peer_check=rank1_is_gone
    )
    t0 = time.monotonic()
    saver.save(5, sources({0: layer(0)}), manifest={"model": {}}, trainer_state={})
    with pytest.raises(RuntimeError, match="rank 1 died"):
        saver.wait()
    assert time.monotonic() - t0 < 60
    assert find_resume("auto", tmp_path) is None  # nothing committed
    saver.save(6, sources({0: layer(0)}), manifest={"model": {}}, trainer_state={})
    saver.close(failing=True)  # the save's error does not replace the job's
