"""Data-parallel replicas of the pipeline on CPU with gloo (:mod:`sysx.replicas`): R=2 replicas of a
2-rank pipeline (4 processes) equal the single-process reference fed the union of the replicas'
batches, within one node (gradients meet in shared memory; sysx and gpipe) and across two
localhost "nodes" (reduce and shard exchange over gloo; sysx), fp32, clipping on, 20 steps: losses and parameters within
1e-6 relative, gradient norms within 1e-6 of the exact (fp64) norm of the reference's gradients
(torch's fp32 norm, which the reference clips with, is itself ~1.3e-6 off it on this model).
Launched like tests/test_runtime_procs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_runtime_procs import run_parity

pytestmark = pytest.mark.slow

TOL = 1e-6
NORM_TOL = 1e-5  # against torch's fp32 norm: see the module doc
MODEL = {"preset": "tiny", "n_layers": 4}
TRAIN = {"micro_batch_size": 2, "micro_batches": 2, "seq_len": 16}
SCHEDULES = [{"schedule": "sysx", "split": 2, "stages_per_rank": 1}, {"schedule": "gpipe"}]


@pytest.mark.timeout(400)
def test_two_replicas_of_a_2_rank_pipeline_equal_the_reference(tmp_path: Path) -> None:
    runs = {}
    for local_world, nodes in ((4, 1), (2, 2)):  # replicas on one node, then one replica per "node"
        result = run_parity(
            _fresh(tmp_path / f"n{nodes}"),
            world=4,
            local_world=local_world,
            model=MODEL,
            train=TRAIN,
            schedules=SCHEDULES if nodes == 1 else SCHEDULES[:1],  # across "nodes": sysx (the suite's budget)
            steps=20,
            optim={"grad_clip": 1.0},
            replicas=2,
            tol=NORM_TOL,
        )
        assert result["nodes"] == nodes
        for row in result["rows"]:
            print(f"  {nodes} node(s) {row['options']}: grad norm vs its exact value {row['grad_norm_rel_exact']:.1e}")
            assert row["loss_rel"] <= TOL and row["param_rel"] <= TOL and row["param_rel_per_tensor"] <= TOL, row
            assert row["grad_norm_rel_exact"] <= TOL, row
        runs[nodes] = result["rows"]
    # shared memory and gloo add the same two replicas' gradients: the same run, bit for bit
    for one, two in zip(runs[1], runs[2], strict=False):
        assert (one["losses"], one["param_max_abs"]) == (two["losses"], two["param_max_abs"])


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path
