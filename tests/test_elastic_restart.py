"""torchrun's ``--max-restarts`` with ``train.resume=auto``: a job that loses a rank restarts and
finishes with the losses of an uninterrupted run.

Ranks are SIGKILLed through ``SYSX_FAULT`` (:mod:`sysx.faults`; its ``#ATTEMPT`` suffix picks the
attempt): 2 ranks under ``python -m sysx.launch``, rank 1 killed mid-step, one restart; 4 ranks
under ``launch/two_nodes_localhost.sh`` (2 per "node", torchrun options through ``TORCHRUN_ARGS``),
rank 1 killed mid-step in the first attempt and rank 3 in the middle of a checkpoint save in the
second, so the third resumes from the checkpoint before the save that never completed (and rank
0's commit of that save must not wait for rank 3's layers). One uninterrupted 2-rank run is the reference: with
the schedule fixed, 2 and 4 ranks compute the same losses bit for bit. Nothing of the job is left
(processes, ``/dev/shm`` segments).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_runtime_procs import ROOT, free_port
from test_stop import AGENT_LINE, start_launcher

RESTART_ARGS = [
    "model=tiny",
    "schedule=sysx",
    "parallel.replicas=1",  # one pipeline of both ranks: the tuner would make them 2 replicas of the tiny model
    "train.steps=12",
    "checkpoint.every=3",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.micro_batches=4",
    "eval.every=0",
    "log.every=1",
    "device=cpu",
    "optim.backend=torch",
    "schedule.timeout_s=60",
]
JOB_S = 240.0  # three attempts of a tiny job on a busy machine


def losses(run_dir: Path) -> list[float]:
    """The loss of every step in ``run_dir/metrics.jsonl``, in order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(len(rows))), rows
    return [float(r["loss"]) for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the same job without a failure (2 ranks, no restart)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    job = start_launcher(tmp_path, "sysx.launch", RESTART_ARGS)
    try:
        job.wait_all(timeout=JOB_S)
        assert job.procs[0].returncode == 0, job.errors()
    finally:
        job.kill()
    found = losses(tmp_path / "run")
    assert len(found) == 12
    return found


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_S)
@pytest.mark.parametrize(
    ("launcher", "fault", "deaths", "resumed"),
    [
        # a rank SIGKILLed mid-step: one restart, resumed from the save of step 3
        ("sysx.launch", "kill@1:step 4#0", [(1, "step 4")], ["00000003"]),
        # lost twice: mid-step on one "node", then mid-save on the other (the save of step 9 never completes)
        ("two_nodes", "kill@1:step 4#0,kill@3:save 9#1", [(1, "step 4"), (3, "save 9")], ["00000003", "00000006"]),
    ],
    ids=["2-ranks-sysx.launch", "4-ranks-two-nodes-lost-twice"],
)
def test_a_job_that_loses_a_rank_restarts_and_finishes_as_if_uninterrupted(
    tmp_path: Path, uninterrupted: list[float], launcher: str, fault: str, deaths: list, resumed: list[str]
) -> None:
    restarts = f"--max-restarts={len(deaths)}"
    job = start_launcher(tmp_path, launcher, RESTART_ARGS, NPROC="2", SYSX_FAULT=fault, TORCHRUN_ARGS=restarts)
    try:
        job.wait_all(timeout=JOB_S)
        stderr, stdout = "".join(job.stderr[0]), "".join(job.stdout)
        assert job.procs[0].returncode == 0, stderr
        assert "Traceback" not in stderr and not [x for x in stderr.splitlines() if AGENT_LINE.match(x)], stderr
        for rank, label in deaths:
            assert re.search(rf"rank {rank} died \(pid \d+ is gone: killed or crashed\) during {label}", stderr), stderr
        assert re.findall(r"resumed from \S+step-(\d+) at step \d+", stdout) == resumed, stdout
        assert losses(tmp_path / "run") == uninterrupted
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["steps"] == 12 - int(resumed[-1]) and summary["stopped"] is None, summary  # the last attempt's
        job.check_nothing_left()
    finally:
        job.kill()


# Node 0's worker fails at once; node 1's stays healthy until its agent restarts it for the new
# rendezvous round, which torch does not count as a restart: the agents' restart counts then differ.
DIVERGING_WORKER = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from sysx import dist as sdist
node = os.environ["GROUP_RANK"]
first = Path(sys.argv[1]) / f"started-{node}"
if not first.exists():
    first.touch()
    sys.exit(3) if node == "0" else time.sleep(120)
info = sdist.init(timeout_s=30)
dist.barrier()
print(f"joined: rank {info.rank}, restart count {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("nnodes", "counts"),
    [("2", ["1", "1"]), ("1:2", ["1", "0"])],
    ids=["fixed-size-counted-alike", "elastic-counted-apart"],
)
def test_a_restart_joins_whichever_way_the_nodes_agents_count_it(
    tmp_path: Path, nnodes: str, counts: list[str]
) -> None:
    """The lost-twice flake, made certain: node 0's rank fails at once and node 1's keeps running
    until its agent restarts it for the new rendezvous round, which torch does not count. With
    torchrun's shared store the new attempt's ranks met under a prefix of each node's own count and
    waited apart until ``schedule.timeout_s`` (``RendezvousClosedError``). ``sysx.launch`` counts
    that restart on a fixed-size job (:func:`sysx.launch.count_every_restart`), and gives every
    attempt its own store (:func:`sysx.launch.fresh_store_per_attempt`), which is what lets an
    elastic job's ranks, still counted apart, join."""
    worker = tmp_path / "worker.py"
    worker.write_text(DIVERGING_WORKER)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SYSX_JOB_ID", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    common = [f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    common += [f"--rdzv_id=diverging{port}", "--max-restarts=1"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "sysx.launch", *common, f"--node_rank={node}", str(worker), str(tmp_path)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=200) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    joined = sorted(line for out, _ in outputs for line in out.splitlines() if line.startswith("joined"))
    assert joined == [f"joined: rank {rank}, restart count {count}" for rank, count in enumerate(counts)], outputs
