"""The parameter pool: every load's place planned once from the op list, the plan's parameter memory
equal to the bytes the runtime allocates (issue 27: equal buffers held up to 1.7x the plan)."""

from __future__ import annotations

import pytest
import torch

from sysx import device as dev
from sysx.partition import uniform_partition
from sysx.runtime.buffers import BufferError, ParamPool, load_places
from sysx.schedule import SCHEDULES, Costs, OpKind, build, simulate
from sysx.schedule.param_pool import place_loads


def _costs(n_layers: int, layer_params: list[float]) -> Costs:
    return Costs(layer_fwd_time=(1.0,) * n_layers, layer_params=tuple(layer_params), act_bytes=1e6)


def _loads(schedule, rank: int, numels: list[int]) -> list[tuple[int, int, int, int]]:
    """``(load op index, free op index, lo, hi)`` of every load of ``rank``'s list."""
    places, _ = load_places(schedule, schedule.ops[rank], numels)
    out, open_ = [], {}
    ends = [0]
    for x in numels:
        ends.append(ends[-1] + x)
    ops = schedule.ops[rank]
    for i, op in enumerate(ops):
        unit = (op.stage, op.sub)
        if op.kind == OpKind.LOAD_PARAMS:
            r = schedule.layers(op)
            open_[unit] = (i, places[i], places[i] + ends[r.stop] - ends[r.start])
        elif op.kind == OpKind.FREE:
            start, lo, hi = open_.pop(unit)
            out.append((start, i, lo, hi))
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_no_two_units_on_the_device_together_share_pool_space(name: str) -> None:
    one_stage = name in ("gpipe", "1f1b")
    part = uniform_partition(4 if one_stage else 8, 3 if name == "sysx" else 1, layers_per_sub=2)
    numels = [1000 + 37 * i for i in range(part.n_layers)]  # unequal layers: unequal units
    schedule = build(name, 4, 8, part, param_buffers=3)
    for rank in range(schedule.n_ranks):
        loads = _loads(schedule, rank, numels)
        assert loads, f"rank {rank} loads nothing"
        for a in loads:
            for b in loads:
                if a is not b and a[0] < b[1] and b[0] < a[1]:  # on the device at the same time
                    assert a[3] <= b[2] or b[3] <= a[2], f"{name} rank {rank}: {a} and {b} overlap"


def test_the_plan_charges_the_pool_the_runtime_allocates() -> None:
    """The simulator's parameter peak per rank is the pool's size, the same number the runtime sizes
    its buffer with (both from place_loads), for SysX loading whole stages forward and thirds back."""
    part = uniform_partition(4, 3)  # 12 layers, 4 stages of 3 layers, sub-stages of 1 layer
    numels = [3000, 1000, 1000, 2000, 1000, 1000, 1500, 500, 1000, 1000, 1000, 1000]
    schedule = build("sysx", 2, 4, part, param_buffers=3)
    bytes_per = 2.0
    tl = simulate(schedule, _costs(part.n_layers, [float(n) for n in numels]), record=False)
    for rank in range(schedule.n_ranks):
        _, size = load_places(schedule, schedule.ops[rank], numels)
        assert tl.peak_params[rank] == pytest.approx(size * bytes_per)


def test_sysx_packs_its_stage_and_sub_stages_below_equal_buffers() -> None:
    """One stage per rank, d = 3, three buffers: a forward stage and two sub-stages are on the device
    at most, 5/3 of a stage; three buffers each a stage large held 3 stages."""
    part = uniform_partition(2, 3)
    numels = [100] * part.n_layers
    schedule = build("sysx", 2, 2, part, param_buffers=3)
    stage = 300
    for rank in range(2):
        _, size = load_places(schedule, schedule.ops[rank], numels)
        assert size <= stage + 2 * 100 < 3 * stage


def test_place_loads_falls_back_to_equal_buffers_when_they_are_smaller() -> None:
    # largest-first puts the big unit at 0 and the two small ones after it; equal buffers of the big
    # size would need 3 x 4; the smaller packing wins either way and never exceeds equal buffers
    events = [(True, "a", 1.0), (True, "b", 4.0), (False, "a", 1.0), (True, "c", 1.0), (False, "b", 4.0)]
    plan = place_loads(events + [(False, "c", 1.0)])
    assert plan.size == 5.0
    same = [(True, k, 2.0) for k in "abc"] + [(False, k, 2.0) for k in "abc"]
    assert place_loads(same).size == 6.0
    with pytest.raises(ValueError, match="loaded twice"):
        place_loads([(True, "a", 1.0), (True, "a", 1.0)])


def test_a_load_placed_over_a_loaded_unit_is_refused() -> None:
    cpu = torch.device("cpu")
    stream = dev.Stream(cpu)
    pool = ParamPool(10, torch.float32, cpu, layer_numels=[4, 4, 2], h2d=stream, compute=stream)
    pool.load((0, 0), range(0, 1), [torch.ones(4)], "LOAD s0.0", at=0)
    with pytest.raises(BufferError, match=r"placed at \[2, 6\) does not fit"):
        pool.load((0, 1), range(1, 2), [torch.ones(4)], "LOAD s0.1", at=2)
    pool.load((0, 1), range(1, 2), [torch.full((4,), 2.0)], "LOAD s0.1", at=4)
    assert pool.view(range(1, 2), "F").tolist() == [2.0] * 4
    pool.free((0, 0), "FREE s0.0")
    pool.load((0, 2), range(2, 3), [torch.full((2,), 3.0)], "LOAD s0.2", at=0)
    assert pool.view(range(2, 3), "F").tolist() == [3.0, 3.0] and pool.view(range(1, 2), "F").tolist() == [2.0] * 4
    with pytest.raises(BufferError, match="does not fit"):
        pool.load((0, 0), range(0, 1), [torch.ones(4)], "LOAD s0.0", at=8)  # past the end


class _Waits(dev.Stream):
    """A CPU stream that notes the events it is ordered after."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.waited: list[dev.Event] = []

    def wait_event(self, event: dev.Event) -> None:
        self.waited.append(event)


def _freed_at_0(numel: int) -> tuple[ParamPool, _Waits, dev.Event]:
    """A pool of ``numel`` whose layer 0 (4 elements) was loaded at 0 and freed: the pool, its
    noting H2D stream and the freeing event (done: on CPU a recorded event is)."""
    h2d = _Waits()
    pool = ParamPool(
        numel, torch.float32, torch.device("cpu"), layer_numels=[4, 4], h2d=h2d, compute=dev.Stream(torch.device("cpu"))
    )
    pool.load((0, 0), range(0, 1), [torch.ones(4)], "LOAD s0.0", at=0)
    pool.free((0, 0), "FREE s0.0")
    freed = pool.released[0][2]
    assert freed.query()
    return pool, h2d, freed


def test_reused_space_is_waited_for_even_when_its_compute_is_done() -> None:
    """A load over a freed extent and a gradient buffer taken back after its copy wait on the event
    that freed them even when it has completed: the wait costs nothing, and without it the CUDA
    sanitizer saw no order between the streams (the sysx schedule on an H200, second lease)."""
    from sysx.runtime.buffers import GradBuffers

    pool, h2d, freed = _freed_at_0(8)
    cpu = torch.device("cpu")
    pool.load((0, 1), range(1, 2), [torch.ones(4)], "LOAD s0.1", at=2)
    assert h2d.waited == [freed] and pool.released == []  # waited for, then dropped

    d2h, compute = dev.Stream(cpu), _Waits()
    grads = GradBuffers(torch.float32, cpu, compute=compute, d2h=d2h)
    grads.get((0, 0), 4).fill_(1.0)
    copied = grads.offload((0, 0), torch.empty(4))
    assert grads.get((0, 1), 4).tolist() == [0.0] * 4 and compute.waited == [copied]  # the same buffer, reused


def test_a_done_extent_stays_until_a_load_over_it_waits_for_it() -> None:
    """The sanitizer orders streams by waits alone, not by the host seeing an event done: an extent
    whose compute is done but which no load has overlapped yet stays in the list, and the first
    load over it, however much later, waits for its event."""
    pool, h2d, freed = _freed_at_0(12)
    pool.load((0, 1), range(1, 2), [torch.ones(4)], "LOAD s0.1", at=8)  # elsewhere: [8, 12)
    assert h2d.waited == [] and [(a, b) for a, b, _ in pool.released] == [(0, 4)]  # done, and kept
    pool.free((0, 1), "FREE s0.1")
    pool.load((0, 0), range(0, 1), [torch.ones(4)], "LOAD s0.0", at=2)  # over [0, 4), not [8, 12)
    assert h2d.waited == [freed] and [(a, b) for a, b, _ in pool.released] == [(8, 12)]
