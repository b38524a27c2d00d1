"""Resume of the multi-process pipelines: bit-identical at 2 ranks for sysx and mobius in fp32 and
fp16, a checkpoint carried across rank counts and schedules (sysx at 4 ranks -> sysx at 2 -> the
single-device window) continues, and one carried across data-parallel replica counts
(:mod:`sysx.replicas`) loads bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_runtime_procs import ROOT, launch

JOB = ROOT / "tests" / "resume_job.py"
MODEL = {"dim": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
BASE = {
    "model": MODEL,
    "train": {"steps": 6, "micro_batch_size": 2, "micro_batches": 4, "seq_len": 16},
    "optim": {"lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5},
    "eval": {"every": 0},
    "device": "cpu",
}
FP16 = {"precision": "fp16", "loss_scale": {"init": 65536.0, "growth_interval": 2}}

pytestmark = pytest.mark.slow


def run_job(
    tmp_path: Path, world: int, cfg: dict, schedules: list[dict], phases: list[list], local_world: int | None = None
) -> None:
    """``phases`` as tests/resume_job.py reads them; ``local_world``: processes per node (default: one node)."""
    spec = tmp_path / f"spec-{world}.json"
    spec.write_text(json.dumps({"cfg": cfg, "schedules": schedules, "phases": phases}))
    procs = launch([sys.executable, str(JOB), str(spec), str(tmp_path)], world, local_world or world, timeout=400)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def load(tmp_path: Path, index: int, phase: str) -> dict:
    return torch.load(tmp_path / f"{index}-{phase}.pt")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sysx_and_mobius_resume_bit_identically_on_2_ranks(tmp_path: Path, precision: str) -> None:
    """Both also save from and resume into the NVMe tier's state files (streamed checkpoints),
    against the same uninterrupted host-memory run; in fp16 sysx's ranks (4 sub-stages each) convert
    their fp32 gradients per job into a pool, again at each overflow's undo (mobius's 2 keep theirs)."""
    cfg = {**BASE, **(FP16 if precision == "fp16" else {})}
    schedules = [{"schedule": "sysx"}, {"schedule": "mobius"}]
    ckpt = str(tmp_path / "ckpt")
    phases = [["straight", 6, ckpt + "-straight", ""], ["first", 3, ckpt, "save"], ["second", 3, ckpt, "resume"]]
    (tmp_path / "nvme").mkdir()
    nvme = {"optim": {"offload": "nvme", "nvme_dir": str(tmp_path / "nvme"), "nvme_engine": "threads"}}
    phases += [["first-nvme", 3, ckpt + "-nvme", "save", nvme], ["second-nvme", 3, ckpt + "-nvme", "resume", nvme]]
    run_job(tmp_path, 2, cfg, schedules, phases)
    for index in range(len(schedules)):
        straight = load(tmp_path, index, "straight")
        for suffix in ("", "-nvme"):
            first, second = (load(tmp_path, index, p + suffix) for p in ("first", "second"))
            assert first["results"] + second["results"] == straight["results"], (schedules[index], suffix)
            assert all(torch.equal(second["state"][k], v) for k, v in straight["state"].items()), schedules[index]
        if precision == "fp16":
            assert any(skipped for _, _, _, skipped, _ in straight["results"])


@pytest.mark.timeout(600)  # 91 s with the 2 cores busy (issue 12); several launches
def test_a_checkpoint_moves_from_4_ranks_to_2_ranks_to_the_window(tmp_path: Path) -> None:
    """Layers are the unit of a checkpoint, so any layout reads any other's. Exactness, measured:
    sysx at 4 ranks -> sysx at 2 ranks continues bit for bit (CPU Adam is elementwise, the layers'
    arithmetic does not depend on the partition, the gradient norm is summed per layer:
    sysx.optim.grad_norm); the window sums its gradient norm in another
    order, so its continuation agrees to the last bits only."""
    from resume_job import make_config

    from sysx.trainers.checkpointing import JobCheckpoints
    from sysx.trainers.single import SingleTrainer

    cfg = {**BASE, "train": {**BASE["train"], "steps": 6}}
    ckpt = str(tmp_path / "moved")
    run_job(tmp_path, 4, cfg, [{"schedule": "sysx", "stages_per_rank": 1, "split": 2}], [["a", 2, ckpt, "save"]])
    run_job(
        tmp_path,
        2,
        cfg,
        [{"schedule": "sysx", "split": 2}],
        [["b", 2, ckpt, "resume save"], ["straight", 6, str(tmp_path / "straight"), ""]],
    )
    straight = load(tmp_path, 0, "straight")
    a, b = load(tmp_path, 0, "a"), load(tmp_path, 0, "b")
    assert a["results"] + b["results"] == straight["results"][:4]  # 4 ranks -> 2 ranks: exact
    with SingleTrainer(make_config(cfg, ckpt + "-0")) as window:
        ckpts = JobCheckpoints(window)
        assert ckpts.resume() is not None and window.step_index == 4
        rest = window.run(2)
        ckpts.close()
    for got, want in zip(rest, straight["results"][4:]):
        assert got.step == want[0] and got.loss == pytest.approx(float(want[1]), rel=1e-5)


REPLICAS = {
    "model": {"preset": "tiny", "n_layers": 4},
    "train": {"steps": 6, "micro_batch_size": 2, "micro_batches": 2, "seq_len": 16},
    "optim": {"lr": 1e-3, "warmup_steps": 1, "grad_clip": 0.5},
    "eval": {"every": 0},
    "device": "cpu",
}


def replicas(r: int, micro_batches: int = 2) -> dict:
    """A phase's config: ``r`` replicas of ``micro_batches`` each (R x M = 4: every phase's global batch)."""
    return {"parallel": {"replicas": r}, "train": {"micro_batches": micro_batches}}


def loaded_layers(tmp_path: Path, phase: str, world: int) -> dict[int, dict]:
    """Every layer a phase's trainer held right after its resume (dumped by each of its ranks, once)."""
    out: dict[int, dict] = {}
    for rank in range(world):
        part = torch.load(tmp_path / f"0-{phase}-layers-{rank}.pt")
        assert not out.keys() & part.keys(), (phase, sorted(part))  # replica 0 answers for every shard
        out.update(part)
    return out


def assert_loaded_bit_for_bit(loaded: dict[int, dict], ckpt_dir: Path, step: int, *, blocks: int | None = None) -> None:
    """The masters, moments and step counts loaded equal the checkpoint's bit for bit (a model of
    ``blocks`` blocks; default: ``REPLICAS``')."""
    from sysx.checkpoint import Checkpoint

    ckpt = Checkpoint(ckpt_dir / f"step-{step:08d}")
    n_blocks = REPLICAS["model"]["n_layers"] if blocks is None else blocks
    assert sorted(loaded) == list(range(n_blocks + 2))
    for index, got in loaded.items():
        saved = ckpt.layer(index)
        assert got["step"] == saved.step, index
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            want = getattr(saved, kind)
            assert got[kind].keys() == want.keys(), (index, kind)
            for name, t in want.items():
                assert torch.equal(got[kind][name].view(torch.int32), t.view(torch.int32)), (index, kind, name)


@pytest.mark.timeout(600)
def test_a_checkpoint_moves_across_replica_counts(tmp_path: Path) -> None:
    """R=2 x P=2 saves at step 2; R=2 resumes it and continues bit for bit the uninterrupted R=2 run;
    R=4 x P=1, R=1 x P=2 and the window load it bit for bit and continue at the same global batch
    (gradients summed in another order: close, not bit-identical); R=1 saves at step 4 and R=2 x P=1
    (one replica per node: the restore's shard exchange over gloo) loads that bit for bit and continues."""
    from resume_job import make_config, phase_fields

    from sysx.trainers.checkpointing import JobCheckpoints
    from sysx.trainers.single import SingleTrainer

    ckpt, sysx = str(tmp_path / "A"), [{"schedule": "sysx", "split": 2, "stages_per_rank": 1}]
    run_job(
        tmp_path,
        4,
        REPLICAS,
        sysx,
        [
            ["a", 2, ckpt, "save", replicas(2)],
            ["r2", 2, ckpt, "resume dump", replicas(2)],
            ["r4", 2, ckpt, "resume dump", replicas(4, 1)],
            ["straight", 4, str(tmp_path / "straight"), "", replicas(2)],
        ],
    )
    straight = load(tmp_path, 0, "straight")
    a, r2, r4 = (load(tmp_path, 0, p) for p in ("a", "r2", "r4"))
    assert a["results"] + r2["results"] == straight["results"]  # R=2 -> R=2: exact
    assert all(torch.equal(r2["state"][k], v) for k, v in straight["state"].items())
    for phase in ("r2", "r4"):
        assert_loaded_bit_for_bit(loaded_layers(tmp_path, phase, 4), tmp_path / "A-0", 2)
    with SingleTrainer(make_config(phase_fields(REPLICAS, replicas(1, 4)), ckpt + "-0")) as window:
        ckpts = JobCheckpoints(window)
        assert ckpts.resume() is not None and window.step_index == 2
        loaded = {
            i: {k: getattr(s(), k) for k in ("weight", "exp_avg", "exp_avg_sq", "step")}
            for i, s in window.checkpoint_layers().items()
        }
        assert_loaded_bit_for_bit(loaded, tmp_path / "A-0", 2)
        rest = window.run(2)
        ckpts.close()
    run_job(
        tmp_path,
        2,
        REPLICAS,
        sysx,
        [
            ["r1", 2, ckpt, "resume dump save", replicas(1, 4)],
            ["r1b", 1, ckpt, "resume", replicas(1, 4)],
            ["back", 1, ckpt, "resume dump", replicas(2)],
        ],
        local_world=1,
    )
    assert_loaded_bit_for_bit(loaded_layers(tmp_path, "r1", 2), tmp_path / "A-0", 2)
    assert_loaded_bit_for_bit(loaded_layers(tmp_path, "back", 2), tmp_path / "A-0", 4)  # R=1 wrote it
    # and R=2 continues it: every replica's working copy got the other replicas' restored shards
    (got,), (want,) = load(tmp_path, 0, "back")["results"], load(tmp_path, 0, "r1b")["results"]
    assert got[0] == want[0] == 4 and float(got[1]) == pytest.approx(float(want[1]), rel=1e-5), (got, want)
    others = {"r4": r4["results"], "r1": load(tmp_path, 0, "r1")["results"], "window": [(r.step, r.loss) for r in rest]}
    for phase, rows in others.items():
        for got, want in zip(rows, straight["results"][2:], strict=True):
            assert got[0] == want[0] and float(got[1]) == pytest.approx(float(want[1]), rel=1e-5), (phase, got, want)
