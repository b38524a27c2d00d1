"""Schedule builders produce complete op lists that validate; broken lists are rejected clearly."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.partition import PartitionError, uniform_partition
from sysx.schedule import (
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    ScheduleOptions,
    build,
    build_gpipe,
    build_interleaved_1f1b,
    build_mobius,
    build_sysx,
    evaluation_schedule,
    validate,
)
from sysx.schedule.ops import B, F


def _shapes() -> list[tuple[int, int]]:
    """Every Ng in 1..8 with Nm = 1, Ng-1 (< Ng), Ng, Ng+1 and 16."""
    out = []
    for ng in range(1, 9):
        for nm in sorted({1, max(1, ng - 1), ng, ng + 1, 16}):
            out.append((ng, nm))
    return out


def _cases() -> list[tuple[str, int, int, int, int, int]]:
    """(schedule, Ng, Nm, Nsf, d, cfg) spreading v = Nsf/Ng over 1..3, d over 1..4, cfg over 0..3."""
    cases = []
    for i, (ng, nm) in enumerate(_shapes()):
        v = 1 + i % 3
        d = 1 + (i + ng) % 4
        cases += [
            ("gpipe", ng, nm, ng, 1, 3),
            ("1f1b", ng, nm, ng, 1, 3),
            ("interleaved_1f1b", ng, nm, ng * v, 1, 3),
            ("mobius", ng, nm, ng * v + (i % 2), 1, 3),
            ("sysx", ng, nm, ng * v + (i % 2), d, i % 4),
        ]
    return cases


@pytest.mark.parametrize("name,ng,nm,nsf,d,cfg", _cases(), ids=lambda x: str(x))
def test_every_builder_validates(name: str, ng: int, nm: int, nsf: int, d: int, cfg: int) -> None:
    s = build(name, ng, nm, n_stages=nsf, split=d, cfg=cfg)
    validate(s)
    assert s.n_ranks == ng and s.n_micro == nm and s.n_stages == nsf
    fwd = [op for ops in s.ops for op in ops if op.kind == OpKind.FORWARD]
    bwd = [op for ops in s.ops for op in ops if op.kind == OpKind.BACKWARD]
    assert len(fwd) == nsf * nm and len(bwd) == nsf * s.split * nm
    assert all(ops[-1].kind in (OpKind.VALIDATE, OpKind.OPTIM_STEP) for ops in s.ops)


def test_sysx_covers_every_split_and_config_on_the_figure_8_shape() -> None:
    for d in range(1, 5):
        for cfg in range(4):
            s = build_sysx(4, 4, n_stages=8, split=d, cfg=cfg)
            validate(s)
            assert s.split == (1 if cfg == 0 else d)


def test_op_strings_read_like_the_paper() -> None:
    assert str(F(3, 2)) == "F s3 mb2"
    assert str(B(5, 1, 0)) == "B s5.1 mb0"
    assert str(Op(OpKind.SEND_CKPT, 0, 1, 0, 2, True)) == "SEND_CKPT s0.1 mb0 ->r2 async"
    assert str(Op(OpKind.RECV_ACT, 3, -1, 1, 0)) == "RECV_ACT s3 mb1 <-r0"
    assert (
        str(Op(OpKind.LOAD_PARAMS, 4)) == "LOAD s4"
        and str(Op(OpKind.OPTIM_STEP, 5, 1, is_async=True)) == "OPT s5.1 async"
    )
    assert str(Op(OpKind.VALIDATE)) == "VALIDATE"
    assert hash(F(3, 2)) == hash(F(3, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        F(0, 0).stage = 1  # type: ignore[misc]


def test_sysx_figure_8_structure_and_checkpoint_plan() -> None:
    s = build_sysx(4, 4, n_stages=8, split=2)
    pl = s.assignment
    for r, ops in enumerate(s.ops):
        for op in ops:
            if op.kind == OpKind.FORWARD:
                assert r == op.stage % 4
            if op.kind == OpKind.BACKWARD:
                assert r == pl.bwd_rank[op.stage][op.sub]
        # forward stages ascending, then backward sub-stages in q order, all micro-batches each
        seq = [op for op in ops if op.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
        assert seq == [F(st, j) for st in pl.fwd_stages(r) for j in range(4)] + [
            B(st, k, j) for st, k in pl.bwd_substages(r) for j in range(4)
        ]
    order0 = [str(op) for op in s.ops[0] if op.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
    assert order0[:8] == [f"F s{st} mb{j}" for st in (0, 4) for j in range(4)]
    assert order0[8:] == [f"B s{st}.1 mb{j}" for st in (7, 5, 3, 1) for j in range(4)]
    # checkpoint plan: one route per (stage, sub, mb); local iff producer == consumer rank
    assert len(s.ckpt_plan) == 8 * 2 * 4
    for rt in s.ckpt_plan:
        assert rt.src == rt.stage % 4 and rt.dst == pl.bwd_rank[rt.stage][rt.sub]
        assert (rt.mode == "local") == (rt.src == rt.dst)
        if rt.mode == "async":
            send, recv = s.ops[rt.src][rt.src_index], s.ops[rt.dst][rt.dst_index]
            assert send == Op(OpKind.SEND_CKPT, rt.stage, rt.sub, rt.mb, rt.dst, True)
            assert recv == Op(OpKind.RECV_CKPT, rt.stage, rt.sub, rt.mb, rt.src, True)
            # the receiver waits for it right before its backward
            ops = s.ops[rt.dst]
            b = ops.index(B(rt.stage, rt.sub, rt.mb))
            w = ops.index(Op(OpKind.WAIT_CKPT, rt.stage, rt.sub, rt.mb, rt.src))
            assert rt.dst_index < w < b and all(o.kind != OpKind.BACKWARD for o in ops[w + 1 : b])
            # posted when produced: right after the forward on the sender (only posts/sends between)
            f = s.ops[rt.src].index(F(rt.stage, rt.mb))
            assert all(o.kind not in (OpKind.FORWARD, OpKind.BACKWARD) for o in s.ops[rt.src][f + 1 : rt.src_index])
    # the async optimizer steps each sub-stage right after its offload
    for ops in s.ops:
        for i, op in enumerate(ops):
            if op.kind == OpKind.OFFLOAD_GRADS:
                assert ops[i + 1] == Op(OpKind.OPTIM_STEP, op.stage, op.sub, is_async=True)


def test_figure_5c_fine_grained_split_does_not_add_checkpoint_transfers() -> None:
    """Paper §3.1: Fig. 5(c) (d=2) needs as many checkpoint transfers as Fig. 5(b) (d=1)."""
    coarse = build_sysx(2, 2, n_stages=2, split=1, cfg=2)
    fine = build_sysx(2, 2, n_stages=2, split=2, cfg=2)
    remote = lambda s: sum(1 for rt in s.ckpt_plan if rt.mode != "local")  # noqa: E731
    assert remote(coarse) == remote(fine) == 2 * 2
    assert {(rt.stage, rt.sub) for rt in fine.ckpt_plan if rt.mode == "local"} == {(1, 0), (0, 1)}


def test_ablation_switches() -> None:
    modes = {cfg: build_sysx(4, 4, n_stages=8, split=2, cfg=cfg) for cfg in range(4)}
    assert modes[0].split == 1 and modes[1].split == 2
    for cfg, s in modes.items():
        ck = {rt.mode for rt in s.ckpt_plan} - {"local"}
        assert ck == ({"sync"} if cfg < 2 else {"async"})
        opt = {op.is_async for ops in s.ops for op in ops if op.kind == OpKind.OPTIM_STEP}
        assert opt == {cfg == 3}
        assert s.options.cfg == cfg
    with pytest.raises(PartitionError, match="cfg=7"):
        build_sysx(4, 4, cfg=7)


def test_baselines_are_coupled_with_a_synchronous_optimizer_after_validate() -> None:
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "mobius"):
        s = build(name, 4, 4)
        assert s.assignment.coupled and all(rt.mode == "local" for rt in s.ckpt_plan)
        for ops in s.ops:
            v = [i for i, op in enumerate(ops) if op.kind == OpKind.VALIDATE]
            opt = [i for i, op in enumerate(ops) if op.kind == OpKind.OPTIM_STEP]
            assert len(v) == 1 and opt and min(opt) > v[0]
            assert not any(op.is_async for op in ops)


def test_parameter_prefetch_and_buffers() -> None:
    m = build_mobius(4, 4, n_stages=8)
    assert [str(op) for op in m.ops[0][:2]] == ["LOAD s0", "LOAD s4"]  # next stage prefetched at the start
    s = build_sysx(4, 4, n_stages=8, split=2)
    ops0 = [str(op) for op in s.ops[0]]
    # the first backward sub-stage is loaded as soon as stage 0's buffer is freed, while stage 4 computes
    assert ops0.index("FREE s0") + 1 == ops0.index("LOAD s7.1") < ops0.index("F s4 mb0")
    # one buffer: no prefetch, every load follows a free; Megatron's chunks reload on every switch
    one = build_interleaved_1f1b(4, 8, uniform_partition(8), param_buffers=1)
    validate(one)
    for ops in one.ops:
        resident = 0
        for op in ops:
            resident += (op.kind == OpKind.LOAD_PARAMS) - (op.kind == OpKind.FREE)
            assert resident <= 1
    assert one.count(OpKind.LOAD_PARAMS) > build_interleaved_1f1b(4, 8, uniform_partition(8)).count(OpKind.LOAD_PARAMS)


def test_builder_errors_name_the_fix() -> None:
    with pytest.raises(PartitionError, match="use 4 stages, or schedule 'mobius'"):
        build_gpipe(4, 4, uniform_partition(8))
    with pytest.raises(PartitionError, match="not a multiple of Ng=4"):
        build_interleaved_1f1b(4, 4, uniform_partition(6))
    with pytest.raises(PartitionError, match="fine-grained backward sub-stages are a sysx feature"):
        build_mobius(2, 2, uniform_partition(4, 2))
    with pytest.raises(PartitionError, match="Nm"):
        build("sysx", 2, 0)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        build("zb", 2, 2)


# --- hand-broken schedules ------------------------------------------------------------------------


def _edit(s: Schedule, rank: int, ops: list[Op]) -> Schedule:
    lists = list(s.ops)
    lists[rank] = tuple(ops)
    return s.with_ops(lists)


def test_missing_receive_names_rank_op_and_partner() -> None:
    s = build_gpipe(2, 2)
    ops = list(s.ops[1])
    i = ops.index(Op(OpKind.RECV_ACT, 0, -1, 1, 0))
    del ops[i]
    with pytest.raises(ScheduleError) as err:
        validate(_edit(s, 1, ops))
    msg = str(err.value)
    assert "rank 0 op #" in msg and "`SEND_ACT s0 mb1 ->r1` has no matching `RECV_ACT s0 mb1 <-r0` on rank 1" in msg
    assert "`F s1 mb1`: its input (output of stage 0, mb 1) was neither computed on this rank nor received" in msg


def test_duplicate_forward_is_rejected() -> None:
    s = build_mobius(2, 2, n_stages=4)
    ops = list(s.ops[0])
    ops.insert(ops.index(F(0, 1)) + 1, F(0, 1))
    with pytest.raises(ScheduleError, match=r"`F s0 mb1` runs 2 times \(rank 0 op #\d+, rank 0 op #\d+\)"):
        validate(_edit(s, 0, ops))


def test_cross_rank_deadlock_is_found_by_execution() -> None:
    """Rank 0 waits for a checkpoint that rank 2 produces only after rank 0's own output went round."""
    s = build_sysx(3, 1, n_stages=3, split=1, cfg=1)
    ops = list(s.ops[0])
    recv = Op(OpKind.RECV_CKPT, 2, 0, 0, 2)
    ops.remove(recv)
    ops.insert(0, recv)
    with pytest.raises(ScheduleError) as err:
        validate(_edit(s, 0, ops))
    msg = str(err.value)
    assert "deadlocks" in msg
    assert "rank 0 op #0 `RECV_CKPT s2.0 mb0 <-r2` waits for rank 2 to reach its SEND_CKPT" in msg
    assert "rank 1 op #" in msg and "rank 2 op #" in msg


def test_pairs_must_post_messages_in_the_same_order() -> None:
    s = build_gpipe(2, 3)
    ops = list(s.ops[0])
    a = ops.index(Op(OpKind.SEND_ACT, 0, -1, 0, 1))
    b = ops.index(Op(OpKind.SEND_ACT, 0, -1, 1, 1))
    ops[a], ops[b] = ops[b], ops[a]
    with pytest.raises(ScheduleError) as err:
        validate(_edit(s, 0, ops))
    assert "post their messages in different orders" in str(err.value)
    assert "sends the output of `F s0 mb1` before computing it here" in str(err.value)


def test_missing_wait_offload_and_sync_step_order_are_rejected() -> None:
    s = build_sysx(2, 2, n_stages=2, split=2, cfg=3)
    r = next(rt.dst for rt in s.ckpt_plan if rt.mode == "async")
    ops = [op for op in s.ops[r] if op.kind != OpKind.WAIT_CKPT]
    with pytest.raises(ScheduleError, match="async RECV_CKPT was posted but no WAIT_CKPT precedes it"):
        validate(_edit(s, r, ops))

    g = build_gpipe(2, 2)
    ops = list(g.ops[1])
    off = Op(OpKind.OFFLOAD_GRADS, 1, 0)
    ops.remove(off)
    ops.insert(ops.index(B(1, 0, 1)), off)
    with pytest.raises(ScheduleError, match=r"backward of micro-batch\(es\) \[1\] of s1.0 did not run on this rank"):
        validate(_edit(g, 1, ops))

    ops = list(g.ops[0])
    v = ops.index(Op(OpKind.VALIDATE))
    ops[v], ops[v + 1] = ops[v + 1], ops[v]
    with pytest.raises(ScheduleError, match="a synchronous optimizer step must follow VALIDATE"):
        validate(_edit(g, 0, ops))


def test_parameters_must_be_loaded() -> None:
    s = build_gpipe(2, 2)
    ops = [op for op in s.ops[0] if op.kind not in (OpKind.LOAD_PARAMS, OpKind.FREE)]
    with pytest.raises(ScheduleError, match="the parameters of layers 0..0 are not loaded"):
        validate(_edit(s, 0, ops))


def test_out_of_range_ops_are_rejected() -> None:
    s = build_gpipe(2, 2)
    ops = list(s.ops[0]) + [Op(OpKind.SEND_ACT, 0, -1, 5, 7)]
    with pytest.raises(ScheduleError, match=r"micro-batch 5 not in 0..1, peer 7 is not another rank in 0..1"):
        validate(_edit(s, 0, ops))


def test_trace_names() -> None:
    assert Op(OpKind.FORWARD, 3, -1, 2).trace_name() == "F s3 mb2"
    assert Op(OpKind.BACKWARD, 5, 1, 0).trace_name() == "B s5.1 mb0"
    assert Op(OpKind.LOAD_PARAMS, 4, -1).trace_name() == "H2D s4"
    assert Op(OpKind.OFFLOAD_GRADS, 5, 1).trace_name() == "D2H s5.1"
    assert Op(OpKind.OPTIM_STEP, 5, 1).trace_name() == "OPT s5.1"
    assert Op(OpKind.SEND_CKPT, 2, 0, 1, 3, True).trace_name() == "SEND ckpt s2.0 mb1"
    assert Op(OpKind.RECV_CKPT, 2, 0, 1, 0, True).trace_name() == "RECV ckpt s2.0 mb1"
    assert Op(OpKind.WAIT_CKPT, 2, 0, 1, 0).trace_name() == "WAIT ckpt s2.0 mb1"
    assert Op(OpKind.RECV_ACT, 3, -1, 0, 1).trace_name() == "RECV act s3 mb0"
    assert Op(OpKind.SEND_GRAD, 3, 1, 0, 1).trace_name() == "SEND grad s3.1 mb0"


@pytest.mark.parametrize("name,ng", [("gpipe", 3), ("1f1b", 4), ("interleaved_1f1b", 2), ("mobius", 3), ("sysx", 4)])
def test_the_evaluation_program_is_a_schedule_that_validates(name: str, ng: int) -> None:
    train = build(name, ng, 4, split=2)
    for n in (1, 3, 6):
        program = evaluation_schedule(train, n)
        validate(program)
        assert not program.options.training and program.n_micro == n and program.ckpt_plan == ()
        assert {op.kind for ops in program.ops for op in ops} <= {
            OpKind.LOAD_PARAMS,
            OpKind.FREE,
            OpKind.FORWARD,
            OpKind.SEND_ACT,
            OpKind.RECV_ACT,
        }
        assert sum(op.kind == OpKind.FORWARD for ops in program.ops for op in ops) == train.n_stages * n


def test_forward_only_validation_still_refuses_what_training_needs() -> None:
    train = build_sysx(2, 2, n_stages=4, split=2)
    program = evaluation_schedule(train, 2)
    ops = [list(x) for x in program.ops]
    ops[0].insert(2, B(0, 0, 0))
    with pytest.raises(ScheduleError, match=r"a forward-only program has no BACKWARD"):
        validate(program.with_ops(ops))
    dropped = [[op for op in x if op != F(1, 1)] for x in program.ops]
    with pytest.raises(ScheduleError, match=r"`F s1 mb1` never runs on any rank"):
        validate(program.with_ops(dropped))
    # the training list without its VALIDATE is refused as before
    no_validate = [[op for op in x if op.kind != OpKind.VALIDATE] for x in train.ops]
    with pytest.raises(ScheduleError, match=r"never runs VALIDATE"):
        validate(train.with_ops(no_validate))


def test_schedule_options_are_typed_fields() -> None:
    s = build_sysx(2, 2, n_stages=4, split=2, cfg=2, param_buffers=3)
    assert s.options == ScheduleOptions(ckpt="async", optimizer="sync", param_buffers=3, cfg=2)
    assert not s.options.async_optimizer and build_sysx(2, 2, n_stages=4, split=2).options.async_optimizer
    assert build("gpipe", 2, 2).options == ScheduleOptions(ckpt="local", optimizer="sync", param_buffers=2)
    with pytest.raises(ScheduleError, match="optimizer mode 'eager'"):
        ScheduleOptions(ckpt="local", optimizer="eager")  # type: ignore[arg-type]
    # no shared cached object: every build is a new schedule
    assert build("gpipe", 2, 2) == build("gpipe", 2, 2) and build("gpipe", 2, 2) is not build("gpipe", 2, 2)


def test_kept_activations_are_an_option_the_cost_table_charges() -> None:
    from sysx.model import get_preset
    from sysx.schedule import costs_from_model

    plain, kept = build("gpipe", 2, 4), build("gpipe", 2, 4, keep_activations=True)
    assert kept.ops == plain.ops and kept.options == dataclasses.replace(plain.options, keep_activations=True)
    with pytest.raises(ScheduleError, match="keep_activations: sysx"):
        build("sysx", 2, 4, keep_activations=True)
    with pytest.raises(ScheduleError, match="keep_activations needs .* not ckpt='async'"):
        ScheduleOptions(ckpt="async", optimizer="sync", keep_activations=True)
    cfg = get_preset("tiny")
    costs = costs_from_model(cfg, 16, 2)
    layers = len(costs.layer_fwd_time)
    plain = build("gpipe", 2, 4, uniform_partition(2, 1, layers_per_sub=layers // 2))
    kept = build("gpipe", 2, 4, plain.partition, keep_activations=True)
    a, b = costs.table(plain), costs.table(kept)
    # no recompute: a backward is bwd_ratio forwards, and a micro-batch holds every layer's activations until it
    assert b.bwd == pytest.approx([x * costs.bwd_ratio / (costs.bwd_ratio + 1) for x in a.bwd])
    assert b.ckpt_mem == pytest.approx(b.bwd_work) and b.ckpt_mem[1] > a.ckpt_mem[1]


def test_validate_first_is_the_same_program_with_a_synchronous_optimizer() -> None:
    """A step that validates before it steps runs SysX CFG3 as CFG2 (every sub-stage steps after
    VALIDATE): same partition and placement, a synchronous optimizer, and a longer plan when the
    optimizer takes time; a schedule already synchronous is its own."""

    from sysx.emulate.device_model import DeviceModel
    from sysx.schedule import simulate, validate_first
    from sysx.schedule.costs import UnitCosts

    s = build("sysx", 4, 8, n_stages=8, split=3)
    v = validate_first(s)
    assert (s.options.optimizer, v.options.optimizer, v.options.cfg) == ("async", "sync", 2)
    assert v.partition == s.partition and v.assignment == s.assignment and v.options.ckpt == s.options.ckpt
    costs = UnitCosts(t_opt=2.0)
    assert simulate(v, costs).iteration > simulate(s, costs).iteration
    mobius = build("mobius", 4, 8)
    assert validate_first(mobius) is mobius
    # the runtime's schedules have posted receives (make_schedule lowers them), and so does the
    # program their validating-first steps are planned with
    from sysx.schedule.posted import post_receives

    lowered = validate_first(post_receives(s))
    assert lowered == post_receives(v) and lowered != v
    # the trainer plans a window with the program most of its steps ran
    model = DeviceModel(s)
    model.validated_first.update({2, 3})
    assert model.plan_schedule([1]) is s
    assert model.plan_schedule([1, 2, 3]).options.optimizer == "sync"
    assert model.plan_schedule([]) is s
