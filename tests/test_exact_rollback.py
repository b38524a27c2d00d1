"""optim.rollback=exact: the backend's in-place step on a spare set, against DeepSpeedCPUAdam bit for
bit with rollbacks interleaved; rollback by not switching; the spare's refresh (in the background,
synchronously when none ran, never over a step that can still be undone); the fp32 master that is
its own working copy; the host budget and the bench.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sysx.optim import CpuAdam, StageOptimizer

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _state(opt: CpuAdam) -> list[torch.Tensor]:
    return [opt.param.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _unaligned(n: int, offset: int, values: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 view of ``n`` elements starting ``offset`` elements into a fresh buffer."""
    t = torch.empty(n + offset)[offset:]
    t.copy_(values)
    return t


@pytest.mark.parametrize(
    "numel,offset",
    [
        (10_007, 0),  # scalar tail of 7 (not a multiple of the 16 or 8 lanes)
        (13, 0),  # tail only
        ((1 << 20) + 37, 0),  # two DeepSpeed chunks
        (4099, 3),  # the caller's parameters 12 bytes off alignment
    ],
)
def test_exact_equals_deepspeed_cpu_adam_over_100_steps(numel: int, offset: int) -> None:
    """fp32 master, AdamW, bias correction and weight decay on, a changing lr, and every fifth step a
    spike that is rolled back: p, m, v equal those of deepspeed.ops.adam.DeepSpeedCPUAdam that skipped
    the rolled-back steps, bit for bit, whether the spare was refreshed after the decision, refreshed
    by the next step itself, or not needed (a final step after its validation)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from sysx.optim.deepspeed_backend import load_op

    load_op()  # DeepSpeedCPUAdam then reuses the op sysx built into the venv's cache (its own build is minutes)
    gen = torch.Generator().manual_seed(numel)
    p0 = torch.randn(numel, generator=gen) * 0.02
    ref_p = torch.nn.Parameter(p0.clone())
    ref = DeepSpeedCPUAdam(
        [ref_p],
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        adamw_mode=True,
        fp32_optimizer_states=True,
    )
    opt = CpuAdam(_unaligned(numel, offset, p0), backend="deepspeed", rollback="exact", **HYPER)
    assert opt.backend == "deepspeed" and opt.rollback_bytes == 12 * numel
    rolled_back = 0
    for step in range(100):
        lr = 1e-3 * (1 + step % 10) / 10
        if step % 5 == 4:  # speculative step on a spike, vetoed: the reference never takes it
            before = _state(opt)
            opt.step(torch.randn(numel, generator=gen) * 1e3, lr=5e-2)
            opt.undo()
            assert _same(_state(opt), before), f"rollback at step {step}"
            rolled_back += 1
        g = torch.randn(numel, generator=gen) * (1e-2 if step % 7 else 1.0)
        ref_p.grad = g.clone()
        ref.param_groups[0]["lr"] = lr
        ref.step()
        opt.step(g, lr=lr, final=step % 3 == 2)
        if step % 2:
            opt.refresh(opt.step_stamp)  # the decision kept it: the background refresh (here inline)
        st = ref.state[ref_p]
        want = [ref_p.detach(), st["exp_avg"], st["exp_avg_sq"]]
        assert _same(_state(opt), want), f"step {step + 1} differs from DeepSpeedCPUAdam"
    assert rolled_back == 20 and opt.step_count == 100
    opt.close()


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_step_then_rollback_is_bit_identical_to_never_stepping(backend: str) -> None:
    """After a step and its rollback, p, m, v, the 16-bit target, the step count and the lr are those
    of an optimizer that never took the step, and both go on identically."""
    gen = torch.Generator().manual_seed(3)
    n = 5003
    p0 = torch.randn(n, generator=gen) * 0.02
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(5)]
    spike = torch.randn(n, generator=gen) * 1e3
    for target_dtype in (torch.float16, torch.bfloat16):
        a = StageOptimizer(
            "a", p0.clone(), backend=backend, rollback="exact", target=torch.empty(n, dtype=target_dtype), **HYPER
        )
        b = StageOptimizer(
            "b", p0.clone(), backend=backend, rollback="exact", target=torch.empty(n, dtype=target_dtype), **HYPER
        )
        for k, g in enumerate(grads[:3] + [None] + grads[3:]):  # None: a steps with the spike and rolls back
            a.new_iteration()
            b.new_iteration()
            if g is None:
                a.load_grads(spike)
                a.apply(5e-2)
                assert not torch.equal(a.target, b.target)
                a.undo()
                continue
            for s in (a, b):
                s.load_grads(g)
                s.apply(1e-3 * (k + 1))
            assert _same(_state(a.optimizer), _state(b.optimizer)), (target_dtype, k)
            assert torch.equal(_bits(a.target.float()), _bits(b.target.float())), (target_dtype, k)
        assert a.optimizer.step_count == b.optimizer.step_count == 5
        assert a.optimizer.lr == b.optimizer.lr
        a.close()
        b.close()


def test_rollback_right_after_a_rollback_and_on_either_buffer_set() -> None:
    """A rollback leaves the set the step read current, whichever of the two it was."""
    gen = torch.Generator().manual_seed(5)
    n = 301
    opt = CpuAdam(torch.randn(n, generator=gen), backend="torch", rollback="exact", **HYPER)
    for k in range(4):  # ends on each buffer set in turn
        before = _state(opt)
        opt.step(torch.randn(n, generator=gen))
        assert not _same(_state(opt), before)
        opt.undo()
        assert _same(_state(opt), before) and opt.step_count == k
        opt.step(torch.randn(n, generator=gen))
    with pytest.raises(RuntimeError, match="no step to undo"):
        opt.undo()
        opt.undo()


def test_torch_backend_exact_equals_its_plain_steps() -> None:
    """backend=torch: the exact mode's steps (on the spare, or final on the current set) are the
    torch backend's in-place steps, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    n = (1 << 18) + 333  # two torch chunks
    p0 = torch.randn(n, generator=gen)
    a = CpuAdam(p0.clone(), backend="torch", rollback="exact", **HYPER)
    b = CpuAdam(p0.clone(), backend="torch", rollback="undo", **HYPER)
    for k in range(12):
        g = torch.randn(n, generator=gen) * 1e-2
        a.step(g, lr=1e-3 / (k + 1), final=k % 4 == 3)
        b.step(g, lr=1e-3 / (k + 1))
    assert _same(_state(a), _state(b))


def test_a_refresh_never_overwrites_a_step_that_can_still_be_undone() -> None:
    """A refresh queued for a decision that a newer speculative step overtook does nothing, so
    that step's rollback still restores the state before it; the spare is refreshed later."""
    gen = torch.Generator().manual_seed(17)
    n = 513
    opt = CpuAdam(torch.randn(n, generator=gen), backend="torch", rollback="exact", **HYPER)
    opt.step(torch.randn(n, generator=gen))
    decided = opt.step_stamp  # the validation keeps step 1 (its refresh is queued, not run yet)
    kept = _state(opt)
    opt.step(torch.randn(n, generator=gen))  # step 2 ran first: it refreshed the spare itself
    assert not opt.refresh(decided) and not opt.refresh()  # late: step 2 may still be undone
    opt.undo()
    assert _same(_state(opt), kept) and opt.step_count == 1
    assert opt.refresh() and not opt.refresh()  # after the undo: one copy, then nothing to do


def test_the_workers_refresh_in_the_background_and_the_next_step_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``refresh_spares`` runs the copy on a worker, unwaited by ``wait_stage`` (a block's load must
    not wait for it); the stage's next step waits for it (one copy, not two) and equals plain steps."""
    from sysx.optim import OptimizerThreads
    from sysx.optim.exact import ExactState

    gate, copies = threading.Event(), []
    copy = ExactState._copy

    def slow_copy(self: ExactState) -> None:
        copies.append(time.perf_counter())
        assert gate.wait(30)
        copy(self)

    monkeypatch.setattr(ExactState, "_copy", slow_copy)
    gen = torch.Generator().manual_seed(19)
    n = 2049
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    stage = StageOptimizer(
        "s", master.clone(), backend="torch", rollback="exact", target=torch.empty(n, dtype=torch.bfloat16), **HYPER
    )
    ref = CpuAdam(master.clone(), backend="torch", rollback="undo", **HYPER)
    with OptimizerThreads([stage], workers=2) as threads:
        threads.submit_step("s", grads[0], None, lr=1e-3)
        threads.wait()
        threads.refresh_spares(["s"])  # the decision: keep it
        threads.wait_stage("s")  # returns although the copy is held at the gate
        deadline = time.perf_counter() + 30
        while not copies and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert len(copies) == 1 and not gate.is_set()
        step = threads.submit_step("s", grads[1], None, lr=1e-3)
        time.sleep(0.2)
        assert not step.done()  # it waits for the refresh
        gate.set()
        threads.wait()
    assert len(copies) == 1
    for g in grads:
        ref.step(g, lr=1e-3)
    assert _same(_state(stage.optimizer), _state(ref))
    stage.close()


def test_the_current_set_written_from_outside_is_what_the_next_step_reads() -> None:
    """A checkpoint restore (write the current set, then resume_at) and a device-lane step (written
    in place on the current set) leave the spare stale: the next speculative step refreshes it."""
    from sysx.optim.device_lane import DeviceLane

    gen = torch.Generator().manual_seed(23)
    n = 4000
    a = CpuAdam(torch.randn(n, generator=gen), backend="torch", rollback="exact", **HYPER)
    b = CpuAdam(a.param.clone(), backend="torch", rollback="undo", **HYPER)
    g = torch.randn(n, generator=gen)
    for opt in (a, b):
        opt.step(g)
    assert a.refresh(a.step_stamp)
    saved = [torch.randn(n, generator=gen) for _ in range(3)]
    for opt in (a, b):  # a restore
        for t, v in zip((opt.param, opt.exp_avg, opt.exp_avg_sq), saved):
            t.copy_(v.abs() if t is opt.exp_avg_sq else v)
        opt.resume_at(7)
        opt.step(g)
    assert _same(_state(a), _state(b))
    lane = DeviceLane("cpu")  # the device lane's real path: copies in, steps, copies back in place
    for opt in (a, b):
        lane.step(opt, g, lr=1e-3)
        opt.step(g)
    assert _same(_state(a), _state(b))
    copies = a.inline_refreshes
    for opt in (a, b):  # the emulated device's lane: a final host step, on the current set
        DeviceLane(None).step(opt, g, lr=1e-3)
    assert _same(_state(a), _state(b)) and a.inline_refreshes == copies and not a.can_undo


def test_an_fp32_master_that_is_the_working_copy_stays_current() -> None:
    """With no target (fp32: the shared copy is the master), the given tensor always holds the
    current master, after steps on either buffer set and after a rollback."""
    gen = torch.Generator().manual_seed(13)
    n = 777
    home = torch.randn(n, generator=gen)
    s = StageOptimizer("s", home, backend="torch", rollback="exact", **HYPER)
    for k in range(3):
        s.new_iteration()
        before = home.clone()
        s.load_grads(torch.randn(n, generator=gen))
        s.apply(1e-3)
        assert torch.equal(home, s.master) and not torch.equal(home, before), k
        s.undo()
        assert torch.equal(home, before) and torch.equal(s.master, before), k
        s.load_grads(torch.randn(n, generator=gen))
        s.apply(1e-3)
        assert torch.equal(home, s.master), k


def test_the_host_budget_counts_the_exact_buffers() -> None:
    """12 bytes per parameter (16 when the working copy is fp32: a private master too), in the
    node plan the job checks before it allocates; undo and auto (before resolving) count none."""
    from sysx.memory.budget import plan_host_memory, training_state_bytes

    assert training_state_bytes("bfloat16", rollback="exact").snapshot == 12
    assert training_state_bytes("float32", rollback="exact").snapshot == 16
    assert training_state_bytes("bfloat16", rollback="snapshot").snapshot == 12
    assert training_state_bytes("bfloat16", rollback="auto").snapshot == 0
    n = 1000
    undo = plan_host_memory([(n, "bfloat16")])
    exact = plan_host_memory([(n, "bfloat16")], rollback="exact")
    assert exact.rollback == 12 * n and exact.total - undo.total == 12 * n
    assert "rollback buffers" in str(exact) and "rollback buffers" not in str(undo)
    stage = StageOptimizer(
        "s", torch.zeros(n), lr=1e-3, backend="torch", rollback="exact", target=torch.zeros(n, dtype=torch.bfloat16)
    )
    assert stage.optimizer.rollback_bytes == exact.rollback  # the plan counts what is allocated


def test_auto_picks_exact_when_the_budget_allows_else_undo_and_says_why() -> None:
    from sysx.memory.budget import HostCapacity, HostMemoryError, plan_host_memory
    from sysx.optim.rollback_choice import choose_rollback

    n = 1 << 20

    def plan(rollback: str):
        return plan_host_memory([(n, "bfloat16")], rollback=rollback)

    def cap(ram: int) -> HostCapacity:
        return HostCapacity(shm_free=1 << 40, shm_total=1 << 40, ram_available=ram, cgroup=None)

    roomy, tight = cap(plan("exact").total), cap(plan("exact").total - 1)
    mode, why = choose_rollback("auto", plan, roomy)
    assert mode == "exact" and why.startswith("optim.rollback=auto -> exact:") and "\n" not in why
    mode, why = choose_rollback("auto", plan, tight)
    assert mode == "undo" and why.startswith("optim.rollback=auto -> undo:") and "do not fit" in why
    assert choose_rollback("exact", plan, roomy) == ("exact", "")
    with pytest.raises(HostMemoryError, match="host RAM"):
        choose_rollback("exact", plan, tight)  # an explicit choice is checked, never swapped
    with pytest.raises(HostMemoryError):
        choose_rollback("auto", plan, cap(plan("undo").total - 1))
    with pytest.raises(ValueError, match="optim.rollback='nope' is not valid: allowed: undo, snapshot, exact, auto"):
        choose_rollback("nope", plan, roomy)


def test_auto_on_the_nvme_tier_takes_undo_when_the_second_set_of_files_does_not_fit(tmp_path) -> None:
    """With the tier, exact costs no RAM but a second slot of state files: auto weighs the free space
    of optim.nvme_dir too (before, it took exact and the job was then refused for the disk)."""
    from sysx.memory.budget import HostCapacity, plan_host_memory
    from sysx.optim.rollback_choice import choose_rollback, tier_disk_free

    def plan(rollback: str):
        return plan_host_memory([(1 << 20, "bfloat16")], rollback=rollback, offload="nvme")

    roomy = HostCapacity(shm_free=1 << 40, shm_total=1 << 40, ram_available=1 << 40, cgroup=None)
    exact_disk, undo_disk = plan("exact").disk, plan("undo").disk
    assert exact_disk > undo_disk > 0
    mode, why = choose_rollback("auto", plan, roomy, disk_free=exact_disk)
    assert mode == "exact"
    mode, why = choose_rollback("auto", plan, roomy, disk_free=exact_disk - 1)
    assert mode == "undo" and "state files does not fit optim.nvme_dir" in why and "\n" not in why
    assert choose_rollback("exact", plan, roomy, disk_free=0) == ("exact", "")  # explicit: the disk check names it
    assert tier_disk_free("host", str(tmp_path)) is None and tier_disk_free("nvme", str(tmp_path / "none")) is None
    assert tier_disk_free("nvme", str(tmp_path)) > 0


def test_config_accepts_the_rollback_values_and_names_them_on_a_typo() -> None:
    from sysx.config import ConfigError, load_config

    for value in ("undo", "snapshot", "exact", "auto"):
        assert load_config([f"optim.rollback={value}"]).optim.rollback == value
    with pytest.raises(ConfigError, match="optim.rollback=exactly is not valid: allowed: undo, snapshot, exact, auto"):
        load_config(["optim.rollback=exactly"])
    with pytest.raises(ValueError, match="resolve optim.rollback=auto first"):
        CpuAdam(torch.zeros(4), lr=1e-3, backend="torch", rollback="auto")


def test_bench_optim_prints_one_json_line_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """``sysx bench optim --size ... --json``: the five medians and the machine (no timing asserted)."""
    import json

    from sysx.cli import main

    assert main(["bench", "optim", "--size", "20K", "--repeat", "1", "--warmup", "0", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["size"] == 20_000 and r["threads"] == 1 and r["exact_backend"] == "deepspeed"
    for key in ("step_ms", "exact_step_ms", "exact_refresh_ms", "snapshot_step_ms", "undo_ms"):
        assert r[key] > 0, key
    assert set(r["machine"]) >= {"cpu", "avx2", "avx512", "cores", "load_avg_1m"}
    assert main(["bench", "optim", "--size", "20K", "--repeat", "1", "--warmup", "0"]) == 0
    table = capsys.readouterr().out
    assert "| exact: DeepSpeed's in-place step on the spare set (critical path) |" in table and "x plain" in table
    assert "off the critical path" in table
    assert main(["bench", "optim", "--size", "lots"]) == 2
    assert "--size 'lots' is not valid" in capsys.readouterr().err
