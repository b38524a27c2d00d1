"""Validation stays global across replicas (:mod:`sysx.replicas`): inf written into one replica's
landing buffer of one backward sub-stage (after its offload, before the reduction) makes every rank
of every replica skip that step. R=2 replicas of a 2-rank pipeline (4 processes on CPU, gloo), within
one node (gradients meet in shared memory) and across two localhost "nodes" (gloo reduce, then the
shard exchange). SysX speculated the step, so it is rolled back on every shard: bit for bit the state
before the step with ``optim.rollback=exact`` and ``snapshot``, within ~1 ulp with ``undo``; GPipe
validates first and never steps it. Mostly fp16, because its loss scaler skips an overflowed step and
training goes on, so the scaler and speculation after the skip are seen too (the tiny model keeps
fp16's slow CPU kernels cheap); one fp32 run per layout checks that every rank raises
NonFiniteGradients after the same rollback. Launched like tests/test_runtime_procs.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_runtime_procs import ROOT, launch

pytestmark = pytest.mark.slow

JOB = ROOT / "tests" / "replica_rollback_job.py"
STEPS, BAD_STEP, BAD_RANK = 3, 1, 3  # rank 3: replica 1's pipeline rank 1
ELEMENT = 7  # in shard 0 of the unit: replica 0 sees replica 1's inf only through the reduction
SCALE0 = 2.0**8  # no overflow of its own on this model: the injected one is the only one
CFG = {
    "model": {"preset": "tiny", "n_layers": 4},
    "train": {"steps": STEPS, "micro_batch_size": 2, "micro_batches": 2, "seq_len": 16},
    "optim": {"lr": 1e-3, "warmup_steps": 1, "speculate": "auto", "grad_clip": 0.0},  # no clipping veto
    "eval": {"every": 0},
    "parallel": {"replicas": 2},
    "precision": "fp16",
    "loss_scale": {"init": SCALE0, "growth_interval": 1000},
    "device": "cpu",
}
SYSX = {"schedule": "sysx", "split": 2, "stages_per_rank": 1}
FP32 = {"precision": "fp32"}  # no loss scale: NonFiniteGradients after the rollback
NVME = {"optim": {"offload": "nvme", "nvme_dir": "TMP", "nvme_engine": "threads"}}  # TMP: the test's directory
LAYOUTS = {  # processes per node -> the runs: [name, PipelineOptions fields, config changes]
    4: [
        ["exact", {**SYSX, "rollback": "exact"}],
        ["undo", {**SYSX, "rollback": "undo"}],
        ["gpipe", {"schedule": "gpipe"}],
        ["fp32-exact", {**SYSX, "rollback": "exact"}, FP32],
        ["nvme-exact", {**SYSX, "rollback": "exact"}, NVME],  # the shards' states in the NVMe tier's slots
    ],
    2: [
        ["exact", {**SYSX, "rollback": "exact"}],
        ["snapshot", {**SYSX, "rollback": "snapshot"}],
        ["fp32-snapshot", {**SYSX, "rollback": "snapshot"}, FP32],
    ],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("local_world", sorted(LAYOUTS))
def test_an_overflow_on_one_replica_skips_the_step_on_every_shard(tmp_path: Path, local_world: int) -> None:
    runs = json.loads(json.dumps(LAYOUTS[local_world]).replace('"TMP"', json.dumps(str(tmp_path))))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cfg": CFG, "steps": STEPS, "bad": [BAD_STEP, BAD_RANK, ELEMENT], "runs": runs}))
    procs = launch([sys.executable, str(JOB), str(spec), str(tmp_path)], 4, local_world, timeout=360)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    for name, options, *changes in runs:
        fp32 = changes and changes[0].get("precision") == "fp32"
        rows = [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(4)]
        for rank, row in enumerate(rows):
            where = (local_world, name, rank)
            assert row["reduction"] == ("node" if local_world == 4 else "network"), where
            if fp32:  # the bad step raised on every rank (after the rollback): the run stopped there
                assert row["raised"] and row["skipped"] == [False] * BAD_STEP, (where, row)
            else:
                assert_skipped_once(row, options["schedule"] == "sysx", rank, where)
            assert len(row["steps"]) == 1 and row["steps"][0] == BAD_STEP, (where, row)  # step counts unchanged
            assert row["stale_working_copy"] == 0, (where, row)
            if name == "undo":  # the undo's ~1 ulp: fp16 copies differ only next to a rounding boundary
                assert row["max_rel_diff"] <= 1e-6, (where, row)
                for unit, n in row["shared_mismatch"].items():
                    assert n <= row["shared_numel"][unit] // 1000, (where, unit, row)
            else:
                assert row["bit_equal"], (where, row)
                assert not any(row["shared_mismatch"].values()), (where, row)
        # every replica's working copy of a pipeline rank's units is the same (one copy per node)
        for p in range(2):
            assert rows[p]["working_copy_sha1"] == rows[p + 2]["working_copy_sha1"], (local_world, name, p)
        assert len({tuple(r["losses"]) for r in rows}) == 1


def assert_skipped_once(row: dict, speculates: bool, rank: int, where: tuple) -> None:
    """fp16: the bad step is skipped on this rank, the scaler and speculation go on as with one replica."""
    assert row["overflow"] and row["skipped"] == [s == BAD_STEP for s in range(STEPS)], (where, row)
    # the loss scaler backs off once, on every rank
    assert row["scales"] == [SCALE0] * (BAD_STEP + 1) + [SCALE0 / 2] * (STEPS - BAD_STEP - 1), (where, row)
    # clean steps speculate, a vetoed one makes the next validate first
    assert row["speculated"] == [speculates and s <= BAD_STEP for s in range(STEPS)], (where, row)
    # SysX: every shard of every rank stepped and was rolled back but the one that saw the inf
    # (rank 1 holds shard 0 of the poisoned unit: found inf, never stepped); GPipe: none stepped
    assert row["rolled_back"][BAD_STEP] == (7 if speculates else 0), (where, row)
    assert row["undone"] == ((1 if rank == 1 else 2) if speculates else 0), (where, row)
