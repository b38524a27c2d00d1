"""The runtime in one process: parity with the reference, the executor's errors, p2p checks,
schedule choice, config keys, NVTX names, and the small changes it made to dist and memory.

The multi-process runs (2 and 4 ranks, a killed rank, the launch scripts) are in
tests/test_runtime_procs.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import glob
import re
from pathlib import Path

import pytest
import torch

from sysx.config import (
    ConfigError,
    EvalSection,
    ModelSection,
    OptimSection,
    SysxConfig,
    TrainSection,
    load_config,
    validate,
)
from sysx.data import TokenDataset, default_corpus_path
from sysx.dist import PeerTimeout, wait_for
from sysx.model import get_preset
from sysx.runtime import (
    ExecutionError,
    PipelineOptions,
    RuntimeConfigError,
    StepContext,
    TransferMismatch,
    TransferSpec,
    make_schedule,
    options_from_config,
)
from sysx.runtime.p2p import P2P, Pending
from sysx.schedule import Message, Op, OpKind
from sysx.trainers.pipeline import PipelineTrainer
from sysx.trainers.reference import ReferenceTrainer

TOL = 1e-5


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset(default_corpus_path())


def small_cfg(**train: int) -> SysxConfig:
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        train=TrainSection(**{"steps": 3, "micro_batch_size": 2, "micro_batches": 2, "seq_len": 16, **train}),
        optim=OptimSection(warmup_steps=2),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
    )
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def reference(dataset: TokenDataset) -> tuple[list[float], dict[str, torch.Tensor], float]:
    trainer = ReferenceTrainer(small_cfg(), dataset=dataset)
    losses = [r.loss for r in trainer.run(3)]
    return losses, trainer.state_dict(), trainer.evaluate(2)


def segments(job: str) -> list[str]:
    return glob.glob(f"/dev/shm/sysx-*-{job}-*")


@pytest.mark.parametrize(
    "options",
    [
        {"schedule": "sysx"},
        {"schedule": "sysx", "cfg": 0},
        {"schedule": "gpipe"},
        {"schedule": "interleaved_1f1b"},
    ],
)
def test_world_size_one_matches_the_reference(dataset: TokenDataset, reference: tuple, options: dict) -> None:
    ref_losses, ref_state, ref_val = reference
    trainer = PipelineTrainer(small_cfg(), PipelineOptions(optim_backend="torch", **options), dataset=dataset)
    job = trainer.job_id
    try:
        assert segments(job), "parameters live in shared memory even with one process"
        results = trainer.run(3)
        state = trainer.state_dict()
        val = trainer.evaluate()
    finally:
        trainer.close()
    assert segments(job) == []
    assert [r.step for r in results] == [0, 1, 2]
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=TOL)
    assert val == pytest.approx(ref_val, rel=TOL)
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        assert float((state[name] - value).norm() / value.norm()) <= TOL, name


@pytest.mark.parametrize(
    "head_input_grad,backward_parts,moved,parts",
    [(None, None, {1, 2, 3}, 2), (0, 1, set(), 1), (0, 2, set(), 2), (4, 1, {0, 1, 2, 3}, 1)],
)
def test_the_default_sysx_layout_of_a_deeper_model_matches_the_reference(
    dataset: TokenDataset, head_input_grad: int | None, backward_parts: int | None, moved: set[int], parts: int
) -> None:
    """The default SysX layout is one Block per forward stage with d = 1 (``block_stages``): here 12
    flat layers on one rank in 11 stages, the Embedding with the first Block, the Head alone; by
    default 3 of the 4 micro-batches take the Head's input gradient from its forward, and every
    backward runs in two parts, a sequence each."""
    cfg = dataclasses.replace(small_cfg(micro_batches=4), model=ModelSection(preset="tiny", n_layers=10))
    ref = ReferenceTrainer(cfg, dataset=dataset)
    ref_losses, ref_state = [r.loss for r in ref.run(3)], ref.state_dict()
    opts = PipelineOptions(optim_backend="torch", head_input_grad=head_input_grad, backward_parts=backward_parts)
    with PipelineTrainer(cfg, opts, dataset=dataset) as trainer:
        assert (trainer.schedule.n_stages, trainer.schedule.split) == (11, 1)
        assert list(trainer.schedule.partition.stage_layers(0)) == [0, 1]
        assert list(trainer.schedule.partition.stage_layers(10)) == [11]
        assert trainer.schedule.options.head_igrad == moved
        assert trainer.schedule.options.backward_parts == parts
        losses, state = [r.loss for r in trainer.run(3)], trainer.state_dict()
    assert losses == pytest.approx(ref_losses, rel=TOL)
    for name, value in ref_state.items():
        assert float((state[name] - value).norm() / value.norm()) <= TOL, name


def test_fp16_overflow_skips_the_same_steps_as_the_reference_with_rollback(dataset: TokenDataset) -> None:
    """Loss scale 2**20 overflows some sub-stages' fp16 gradients in the first steps: stages that
    already stepped (async optimizer) are rolled back, the step is skipped and the scale halves,
    exactly where the reference skips."""
    from sysx.config import LossScaleSection

    cfg = SysxConfig(
        model=ModelSection(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(steps=5, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(lr=3e-3, warmup_steps=2),
        eval=EvalSection(every=0),
        device="cpu",
        precision="fp16",
        loss_scale=LossScaleSection(init=2.0**20),
    )
    ref = ReferenceTrainer(cfg, dataset=dataset)
    expected = [(r.skipped, r.scale) for r in ref.run(5)]
    ref_state = ref.state_dict()
    assert [s for s, _ in expected] == [True, True, True, False, False]
    with PipelineTrainer(cfg, PipelineOptions(schedule="sysx", split=2, optim_backend="torch"), dataset=dataset) as t:
        undone = []
        validate_async = t.optimizer.validate_async

        def spy(**kw: float):
            outcome = validate_async(**kw)
            undone.append(outcome.undone)
            return outcome

        t.optimizer.validate_async = spy  # type: ignore[method-assign]
        got = [(r.skipped, r.scale) for r in t.run(5)]
        state = t.state_dict()
    assert got == expected
    assert sum(undone[:3]) > 0 and undone[3:] == [0, 0]
    a = torch.cat([v.flatten() for v in ref_state.values()])
    b = torch.cat([state[k].flatten() for k in ref_state])
    assert float((a - b).norm() / a.norm()) < 1e-3  # fp16 compute; the reference steps with torch.optim.AdamW


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_exact_rollback_run_is_bit_identical_to_a_snapshot_run(
    dataset: TokenDataset, precision: str, backend: str
) -> None:
    """Every sub-stage rolled back by switching buffer sets ends where the bit-exact copy restore
    ends: fp16 overflows (loss scale 2**20) skip the first steps, bf16 clips every step (each
    speculative step is rolled back and stepped again); losses and final weights equal bit for bit,
    with either backend, and the spares were refreshed off the critical path (after each decision)."""
    from sysx.config import LossScaleSection

    cfg = SysxConfig(
        model=ModelSection(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(steps=4, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(
            lr=3e-3, warmup_steps=2, grad_clip=1.0 if precision == "fp16" else 1e-3, speculate="always"
        ),  # every step speculates: the rollbacks are the subject
        eval=EvalSection(every=0),
        device="cpu",
        precision=precision,
        loss_scale=LossScaleSection(init=2.0**20),
    )
    runs = {}
    for rollback in ("snapshot", "exact"):
        opts = PipelineOptions(schedule="sysx", split=2, optim_backend=backend, rollback=rollback)
        with PipelineTrainer(cfg, opts, dataset=dataset) as t:
            outcomes = []
            validate_async = t.optimizer.validate_async

            def spy(_validate=validate_async, _outcomes=outcomes, **kw: float):
                outcome = _validate(**kw)
                _outcomes.append(outcome)
                return outcome

            t.optimizer.validate_async = spy  # type: ignore[method-assign]
            results = t.run(4)
            assert {s.optimizer.rollback for s in t.optimizer.stages.values()} == {rollback}
            # exact: every spare was refreshed by the workers after the decision, none by a step itself
            assert sum(s.optimizer.inline_refreshes for s in t.optimizer.stages.values()) == 0
            runs[rollback] = ([r.loss for r in results], t.state_dict(), outcomes)
    (loss_a, state_a, out_a), (loss_b, state_b, out_b) = runs["snapshot"], runs["exact"]
    if precision == "fp16":
        assert sum(o.undone for o in out_b[:2]) > 0 and out_b[0].skipped
    else:
        assert all(o.restepped > 0 for o in out_b)
    assert [(o.skipped, o.undone, o.restepped) for o in out_a] == [(o.skipped, o.undone, o.restepped) for o in out_b]
    assert loss_a == loss_b
    assert all(torch.equal(state_a[k].view(torch.int32), state_b[k].view(torch.int32)) for k in state_a)


@pytest.fixture
def trainer(dataset: TokenDataset) -> PipelineTrainer:
    t = PipelineTrainer(small_cfg(), PipelineOptions(schedule="sysx", split=2, optim_backend="torch"), dataset=dataset)
    yield t
    t.close()


def test_the_node_memory_plan_counts_what_the_store_and_optimizer_allocate(trainer: PipelineTrainer) -> None:
    plan = trainer.params.node_plan()
    n = trainer.n_params
    assert plan.segments == 4 and plan.master == 0  # fp32: the shared copy is the master
    assert n * 4 <= plan.shared <= n * 4 + 4 * (4096 + 256)  # exact-size segments: header page + alignment
    assert plan.optimizer == 2 * 4 * n and plan.grads == 4 * n and plan.pinned == 0
    assert sum(s.numel for s in trainer.optimizer.stages.values()) == n


def test_an_op_without_handler_is_an_error_naming_the_op(trainer: PipelineTrainer) -> None:
    del trainer.executor.handlers[OpKind.FREE]
    with pytest.raises(ExecutionError, match=r"rank 0: step 0: op #\d+ `FREE s0`: no handler for op kind"):
        trainer.train_step()


def test_an_inconsistent_op_list_is_an_error_naming_rank_step_and_op(trainer: PipelineTrainer) -> None:
    ops = [Op(OpKind.BACKWARD, 1, 1, 0)]
    with pytest.raises(
        ExecutionError, match=r"rank 0: step 7: op #0 `B s1.1 mb0`.*BufferError.*layers 4..5 are not loaded"
    ):
        trainer.executor.run(ops, StepContext(step=7))
    trainer.executor.reset()
    ops = [Op(OpKind.LOAD_PARAMS, 1, 1), Op(OpKind.BACKWARD, 1, 1, 0)]
    with pytest.raises(ExecutionError, match=r"op #1 `B s1.1 mb0`.*checkpoint of B s1.1 mb0 is not available"):
        trainer.executor.run(ops, StepContext(step=7))
    trainer.executor.reset()
    with pytest.raises(ExecutionError, match=r"op #0 `SEND_ACT s0 mb0 ->r1`.*act s0 mb0 is not available"):
        trainer.executor.run([Op(OpKind.SEND_ACT, 0, -1, 0, 1)], StepContext(step=7))


def test_leftover_tensors_are_reported_at_validate(trainer: PipelineTrainer) -> None:
    dropped = (OpKind.BACKWARD, OpKind.OFFLOAD_GRADS, OpKind.OPTIM_STEP)
    ops = [op for op in trainer.ops if not (op.kind in dropped and (op.stage, op.sub) == (0, 0))]
    with pytest.raises(
        ExecutionError,
        match=r"`VALIDATE`.*left over at the end of the step: checkpoint s0.0 mb0, .*input gradient s0.1 mb1",
    ):
        trainer.executor.run(ops, StepContext(step=0, n_micro=2))


def test_transfer_checks_name_stage_micro_batch_and_tensor() -> None:
    spec = TransferSpec(Message.CKPT, 2, 0, 1, (2, 16, 128), torch.float32)
    assert spec.label == "ckpt s2.0 mb1"
    with pytest.raises(
        TransferMismatch,
        match=r"rank 3: op: sending ckpt s2.0 mb1: the tensor is \[2, 16, 64\] "
        r"torch.float32 but the plan says \[2, 16, 128\].*stage 2.0, micro-batch 1, tensor ckpt",
    ):
        spec.check(torch.zeros(2, 16, 64), rank=3, action="op: sending")
    with pytest.raises(TransferMismatch, match="torch.bfloat16"):
        spec.check(torch.zeros(2, 16, 128, dtype=torch.bfloat16), rank=3, action="x")
    spec.check(torch.zeros(2, 16, 128), rank=0, action="x")
    assert TransferSpec.from_header(spec.header(torch.device("cpu")).tolist()) == spec
    assert TransferSpec.from_header([0] * 11) is None

    p2p = P2P(1, device=torch.device("cpu"), timeout_s=1.0, verify=True)
    other = TransferSpec(Message.ACT, 2, -1, 1, (2, 16, 128), torch.float32)
    pending = Pending(
        other,
        0,
        "step 0: op #4 `RECV_ACT s2 mb1 <-r0`",
        [],
        torch.empty(0),
        spec.header(torch.device("cpu")),
        is_send=False,
    )
    with pytest.raises(
        TransferMismatch,
        match=r"rank 1: step 0: op #4 .*rank 0 sent ckpt s2.0 mb1 \[2, 16, 128\].*"
        r"this rank expects act s2 mb1.*disagree about the plan",
    ):
        p2p._check_header(pending)
    # the plan repeats every step: a header goes with the first message of each spec to each peer only
    sent = p2p._sent_headers
    assert p2p._first(sent, 0, spec) and not p2p._first(sent, 0, spec)
    assert p2p._first(sent, 2, spec) and p2p._first(sent, 0, other) and not p2p._first(p2p._sent_headers, 2, spec)
    assert p2p._first(p2p._received_headers, 0, spec)  # each direction on its own
    quiet = P2P(1, device=torch.device("cpu"), timeout_s=1.0, verify=False)
    assert not quiet._first(quiet._sent_headers, 0, spec)


class FakeWork:
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    def wait(self, timeout: datetime.timedelta) -> bool:
        if self.behaviour == "broken":
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore")
        if self.behaviour == "timeout-error":
            raise RuntimeError("Timed out waiting 100ms for recv operation to complete")
        return self.behaviour == "ok"


def test_wait_for_names_rank_op_and_peer_and_tells_a_lost_peer_from_a_timeout() -> None:
    with pytest.raises(
        PeerTimeout,
        match=r"rank 2: op #3 `RECV_ACT s1 mb0 <-r1` with peer rank 1 failed after 0.0 s "
        r"\(Connection closed by peer \[127.0.0.1\]:1234\).*crashed or was killed",
    ):
        wait_for(FakeWork("broken"), rank=2, what="op #3 `RECV_ACT s1 mb0 <-r1`", peer=1, timeout_s=30)
    with pytest.raises(PeerTimeout, match=r"rank 2: VALIDATE did not complete within 0.1 s.*timeout_s"):
        wait_for(FakeWork("never"), rank=2, what="VALIDATE", peer=None, timeout_s=0.1)
    with pytest.raises(PeerTimeout, match=r"did not complete within 0 s \(Timed out"):
        wait_for(FakeWork("timeout-error"), rank=0, what="x", peer=1, timeout_s=0.0)
    # several works: one hand-over to the waiter thread, in order, one timeout for all
    wait_for([FakeWork("ok"), FakeWork("ok")], rank=0, what="sends", peer=None, timeout_s=1.0)
    with pytest.raises(PeerTimeout, match=r"rank 0: sends did not complete within 0.1 s"):
        wait_for([FakeWork("ok"), FakeWork("never")], rank=0, what="sends", peer=None, timeout_s=0.1)


def test_schedule_choice_follows_the_model_and_explains_refusals() -> None:
    tiny = get_preset("tiny")  # 6 flat layers

    def shape(n: int, **kw: object) -> tuple[int, int]:
        s = make_schedule(PipelineOptions(**kw), tiny, n_ranks=n, n_micro=2, seq_len=16)  # type: ignore[arg-type]
        return s.n_stages, s.split

    assert shape(schedule="sysx", n=1) == (2, 3)  # 2 stages of 3 layers: the balanced d = 3
    deep = dataclasses.replace(tiny, n_layers=22)  # 24 flat layers
    # 12 flat layers a rank: one Block per stage (the Embedding with the first), d = 1
    assert make_schedule(PipelineOptions(), deep, n_ranks=2, n_micro=2, seq_len=16).n_stages == 23
    for n, kw, layout in ((4, {}, (8, 3)), (2, {"stages_per_rank": 2}, (4, 3)), (2, {"cfg": 1}, (4, 2))):
        s = make_schedule(PipelineOptions(**kw), deep, n_ranks=n, n_micro=2, seq_len=16)  # type: ignore[arg-type]
        assert (s.n_stages, s.split) == layout, (n, kw)  # 6 layers a rank: 2 stages a rank; CFG1 keeps d = 2
    assert shape(schedule="sysx", n=2) == (2, 2)  # 4 stages cannot all be split: 1 stage per rank, d=2
    assert shape(schedule="sysx", n=4) == (4, 1)
    assert shape(schedule="sysx", n=2, cfg=0) == (4, 1)
    assert shape(schedule="mobius", n=2) == (4, 1)
    assert shape(schedule="gpipe", n=2) == (2, 1)
    with pytest.raises(
        RuntimeConfigError, match=r"needs 8 forward stages but the model has only 6 flat layers.*model.n_layers"
    ):
        make_schedule(PipelineOptions(schedule="sysx", split=4), tiny, n_ranks=4, n_micro=2, seq_len=16)
    with pytest.raises(RuntimeConfigError, match=r"d=4.*lower d"):
        make_schedule(
            PipelineOptions(schedule="sysx", split=4, stages_per_rank=1), tiny, n_ranks=2, n_micro=2, seq_len=16
        )
    with pytest.raises(RuntimeConfigError, match=r"stages_per_rank=2 is not valid for gpipe"):
        PipelineOptions(schedule="gpipe", stages_per_rank=2).check()


def test_schedule_config_keys_reach_the_runtime() -> None:
    cfg = load_config(
        [
            "schedule=sysx",
            "schedule.split=3",
            "schedule.stages_per_rank=1",
            "schedule.cfg=2",
            "optim.rollback=snapshot",
            "optim.backend=torch",
            "optim.workers=2",
            "schedule.timeout_s=12",
        ]
    )
    opts = options_from_config(cfg)
    assert (opts.schedule, opts.split, opts.stages_per_rank, opts.cfg, opts.timeout_s) == ("sysx", 3, 1, 2, 12.0)
    assert (opts.rollback, opts.optim_backend, opts.optimizer_workers) == ("snapshot", "torch", 2)
    assert options_from_config(load_config(["schedule=auto"])).schedule == "sysx"
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "mobius"):
        assert options_from_config(load_config([f"schedule={name}"])).schedule == name
    for bad, word in (
        ("schedule.cfg=5", "0, 1, 2, 3"),
        ("schedule.split=0", ">= 1"),
        ("optim.rollback=no", "undo, snapshot, exact, auto"),
        ("optim.backend=x", "auto, deepspeed, torch"),
        ("schedule.stage_sizes=[3,0]", "positive"),
        ("optim.workers=0", ">= 1"),
        ("schedule.timeout_s=0", "> 0"),
    ):
        with pytest.raises(ConfigError, match=word):
            load_config(["schedule=sysx", bad])


def test_cli_runs_a_pipeline_schedule_in_one_process_and_auto_runs_the_sliding_window_with_its_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sysx.train import main

    args = [
        "train.steps=2",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "eval.every=1",
        "eval.batches=2",
        "device=cpu",
        "optim.backend=torch",
    ]
    assert main(["schedule=sysx", *args, f"run_dir={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: schedule=sysx" in out and "1 rank(s) on 1 node(s) | Nsf=2 d=3" in out and "done: 2 steps" in out
    assert main(["schedule=auto", *args, f"run_dir={tmp_path / 'b'}"]) == 0
    out = capsys.readouterr().out
    assert "schedule=auto -> single (1 process)" in out and "pipeline:" not in out and "done: 2 steps" in out
    a = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    b = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    import json

    assert [json.loads(x)["loss"] for x in a] == pytest.approx([json.loads(x)["loss"] for x in b], rel=TOL)


def test_nvtx_ranges_cover_every_op_and_the_optimizer_threads(
    trainer: PipelineTrainer, nvtx_ranges: list[tuple[str, str]]
) -> None:
    from sysx import trace

    seen = nvtx_ranges
    trace.enable(True)
    trainer.train_step()
    names = {n for n, _ in seen}
    assert {
        "H2D s0",
        "F s0 mb0",
        "F s1 mb1",
        "H2D s1.1",
        "B s1.1 mb0",
        "B s0.0 mb1",
        "D2H s1.1",
        "OPT queue s1.1",
        "VALIDATE",
        "FREE s0",
    } <= names
    workers = {n for n, t in seen if t.startswith("sysx-opt")}
    assert {"OPT s1.1", "OPT s1.0", "OPT s0.1", "OPT s0.0"} <= workers
    assert len(seen) >= len(trainer.ops)


def test_shm_close_collects_garbage_only_when_views_remain(monkeypatch: pytest.MonkeyPatch) -> None:
    """sysx/memory/views.py: closing no longer runs gc.collect() (~0.1-0.4 s each with torch
    loaded) when no tensor view is alive, and still finds views held only by a reference cycle."""
    import mmap

    from sysx.memory.views import MappedBuffer

    calls = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real_collect(*a))
    buf = MappedBuffer(mmap.mmap(-1, 4096), "test map")
    t = buf.tensor(torch.float32, 0, 16)
    del t
    buf.close()
    assert calls == [] and buf.closed

    buf = MappedBuffer(mmap.mmap(-1, 4096), "test map")
    cycle: list = [buf.tensor(torch.float32, 0, 16)]
    cycle.append(cycle)
    del cycle
    buf.close()
    assert calls == [1] and buf.closed


def test_an_execution_error_shows_the_ops_around_the_failing_one(trainer: PipelineTrainer) -> None:
    ops = list(trainer.ops)
    at = next(i for i, op in enumerate(ops) if op.kind == OpKind.BACKWARD)
    ops[at] = Op(OpKind.WAIT_CKPT, 1, 1, 0, 1)  # no receive of that checkpoint was posted
    with pytest.raises(ExecutionError) as info:
        trainer.executor.run(ops, StepContext(step=4))
    trainer.executor.reset()
    lines = str(info.value).splitlines()
    assert re.match(
        rf"rank 0: step 4: op #{at} `WAIT_CKPT s1.1 mb0 <-r1` of schedule 'sysx' failed: RuntimeError: no "
        rf"receive of checkpoint s1.1 mb0 was posted before$",
        lines[0],
    )
    assert lines[1] == f"  rank 0's ops around op #{at} (of {len(ops)}):"
    marked = [line for line in lines if line.endswith("<-- ERROR HERE")]
    assert marked == [f"  {at:>3}  WAIT_CKPT s1.1 mb0 <-r1   <-- ERROR HERE"]
    rows = lines[2:]
    assert rows[0] == "  ..." and rows[-1] == f"  ... ({len(ops) - at - 4} more)"
    assert [line.split()[0] for line in rows[1:-1]] == [str(i) for i in range(at - 3, at + 4)]
    assert f"  {at - 1:>3}  {ops[at - 1]}" in rows


def test_host_bench_measures_every_op_kind_of_a_one_rank_list() -> None:
    from sysx.runtime.host_bench import measure_op_us, probe_config, probe_model

    cfg = probe_config(probe_model(), micro_batches=2, micro_batch_size=1, seq_len=4)
    with PipelineTrainer(cfg, PipelineOptions(schedule="gpipe", optim_backend="torch")) as trainer:
        costs = measure_op_us(trainer, steps=2, warmup=1)
        kinds = {op.kind.name for op in trainer.ops}
    assert costs["ops"] == len(trainer.ops) and kinds <= set(costs), (kinds, costs)
    assert 0 < costs["op best"] <= costs["op"] and costs["step_ms"] == pytest.approx(costs["op"] * costs["ops"] / 1e3)
