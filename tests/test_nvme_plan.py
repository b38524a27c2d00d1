"""optim.offload=nvme planning: the tier's cost arithmetic (hand-checked numbers) and the plan lines."""

from __future__ import annotations

import pytest
import torch

from sysx.memory.budget import plan_host_memory, training_state_bytes
from sysx.memory.node_plan import UnitPlace, node_host_memory
from sysx.optim.nvme.cost import (
    DiskRates,
    disk_shortage,
    largest_model,
    micro_batches_to_hide,
    step_io,
    tier_bytes,
)
from sysx.replicas import ReplicaLayout

GiB = 2**30


@pytest.mark.parametrize(
    ("dtype", "rollback", "disk", "io", "host"),
    [
        ("bfloat16", "undo", 12, 12, 2),  # master + m + v on disk; the bf16 copy in RAM, fp32 grads per rank
        ("bfloat16", "snapshot", 24, 12, 2),  # the second set on disk too
        ("bfloat16", "exact", 24, 12, 2),
        ("float32", "undo", 8, 8, 8),  # the master is the working copy: only m and v move
        ("float32", "snapshot", 24, 12, 8),  # two slots of (p, m, v): a rollback restores p from the old one
        ("float32", "exact", 24, 12, 8),
    ],
)
def test_state_bytes_per_parameter(dtype: str, rollback: str, disk: int, io: int, host: int) -> None:
    plain = training_state_bytes(dtype, rollback=rollback)
    tier = training_state_bytes(dtype, rollback=rollback, offload="nvme")
    assert (tier.disk, tier.step_io, tier.total) == (disk, io, host)
    if dtype == "bfloat16":  # what moved is what the host plan counted; the fp32 grads became a pool per rank
        assert tier.disk == plain.master + plain.adam + plain.snapshot and tier.total + tier.disk + 4 == plain.total
        window = training_state_bytes(dtype, grad_dtype=dtype, rollback=rollback, offload="nvme")
        assert window.grads == 2  # the window's 16-bit gradients stay per parameter (its pool is its planner's)


def test_tier_bytes_of_two_stages() -> None:
    stages = [(1000, "bfloat16"), (3000, "bfloat16")]
    got = tier_bytes(stages)
    assert (got.disk, got.read, got.write) == (48_000, 48_000, 48_000)
    # RAM loses 12 bytes/param of master, m, v and gains 3 staging buffers (1 worker + 2) of the largest
    # stage's p, m, v (12,000 B -> 3 pages each); its 2 stages keep their fp32 grads (a pool of 2 is larger)
    assert got.host_with - got.host_without == 3 * 3 * 3 * 4096 - 48_000
    four = tier_bytes([(1000, "bfloat16"), (3000, "bfloat16"), (2000, "bfloat16"), (3000, "bfloat16")])
    # 4 stages: the fp32 grads (4 x 9,000) become a pool of 2 buffers of the largest (2 x 4 x 3,000)
    assert four.host_with - four.host_without == 3 * 3 * 3 * 4096 - 12 * 9000 - 4 * 9000 + 2 * 4 * 3000
    assert tier_bytes(stages, workers=3).host_with - got.host_with == 2 * 3 * 3 * 4096  # a buffer per worker more
    assert (got.rollback_read, got.rollback_write) == (48_000, 48_000)  # undo reads back and writes again
    snap = tier_bytes(stages, rollback="snapshot")
    assert (snap.disk, snap.rollback_read, snap.rollback_write) == (96_000, 0, 0)
    host = plan_host_memory(stages, rollback="snapshot", offload="nvme")
    assert host.master == host.optimizer == host.rollback == 0 and "state files on disk" in str(host)


def test_node_plan_with_the_tier_counts_one_pool_per_owning_rank() -> None:
    units = [UnitPlace(3000, 0, 0), UnitPlace(1000, 1, 0)]
    two = ReplicaLayout(2, 2, 0, local_world_size=4)  # 2 replicas of 2 ranks on one node: shards of 1/2
    plain = node_host_memory(units, two, 0, "bfloat16")
    tier = node_host_memory(units, two, 0, "bfloat16", offload="nvme")
    assert tier.disk == 4000 * 12 and tier.step_io == 4000 * 12
    # ranks 0 and 2 own 1500-param shards (3 x 6,000 B -> 2 pages each), ranks 1 and 3 500 (3 x 2,000 B -> 1 page)
    assert tier.pinned - plain.pinned == 3 * 3 * 4096 * (2 + 2 + 1 + 1)
    assert tier.total == plain.total - 4000 * 12 + 3 * 3 * 4096 * 6
    assert tier.shared == plain.shared and tier.grads == plain.grads  # replicas keep their fp32 shards


def test_node_plan_with_the_tier_counts_a_gradient_pool_per_owning_rank() -> None:
    """R=1, 16-bit: a rank owning more stages than its pool has buffers converts its fp32 gradients
    into the pool (optimizer workers + 1 buffers of its largest stage), one owning fewer keeps them."""
    units = [UnitPlace(n, 0, 0) for n in (1000, 3000, 2000, 3000)] + [UnitPlace(500, 1, 1), UnitPlace(700, 1, 1)]
    one = ReplicaLayout(1, 2, 0, local_world_size=2)
    plain = node_host_memory(units, one, 0, "bfloat16")
    tier = node_host_memory(units, one, 0, "bfloat16", offload="nvme")
    assert plain.grads == 4 * 10_200
    assert tier.grads == 2 * 4 * 3000 + 4 * (500 + 700)  # rank 0 pools, rank 1's two stages keep theirs
    assert node_host_memory(units, one, 0, "bfloat16", offload="nvme", workers=2).grads == 3 * 4 * 3000 + 4 * 1200
    fp32 = node_host_memory(units, one, 0, "float32", offload="nvme")
    assert fp32.grads == 4 * 10_200  # fp32: the offload lands in each stage's own fp32 gradient buffer


def test_overlap_model_hand_checked() -> None:
    rates = DiskRates(5e9, 2.5e9)
    slow = step_io(10e9, 10e9, rates, step_s=4.0)  # read 2 s + write 4 s on one queue
    assert (slow.io_s, slow.exposed_s, slow.hidden) == (6.0, 2.0, False)
    assert step_io(10e9, 10e9, rates, step_s=8.0).exposed_s == 0.0
    assert "exposed 2 s (50% of the step)" in slow.describe()
    # step(4) = 2 s, step(8) = 3 s: 1 s + 0.25 s per micro-batch reaches 6 s at 20 micro-batches
    assert micro_batches_to_hide(6.0, (4, 2.0), (8, 3.0)) == 20
    assert micro_batches_to_hide(6.01, (4, 2.0), (8, 3.0)) == 21
    assert micro_batches_to_hide(0.5, (4, 2.0), (8, 3.0)) == 1
    assert micro_batches_to_hide(6.0, (4, 2.0), (8, 2.0)) is None


def test_largest_model_with_and_without_the_tier() -> None:
    # bf16 + undo: 20 B/param in RAM without the tier (18 + the 2-byte landing buffer), 4 with it (the fp32
    # gradients are a pool per rank, given as pools per parameter like the staging buffers), 12 on disk
    plain, tier = largest_model(128 * GiB, 1e12, "bfloat16")
    assert plain.params == 128 * GiB // 20 and plain.limit == "host memory"
    assert tier is not None and tier.params == 128 * GiB // 4 and tier.limit == "host memory"
    _, small = largest_model(128 * GiB, 100e9, "bfloat16")
    assert small is not None and (small.params, small.limit) == (int(100e9 // 12), "disk")
    assert largest_model(128 * GiB, None, "bfloat16")[1] is None


def test_disk_shortage_is_one_line_with_the_numbers() -> None:
    assert disk_shortage(10, 10, "/nvme") is None
    line = disk_shortage(3 * GiB, GiB, "/nvme")
    assert line is not None and "\n" not in line
    assert "optim.nvme_dir=/nvme has 1.0 GiB free" in line and "need 3.0 GiB" in line


def test_disk_profile_is_measured_once_per_drive_and_cached(tmp_path, monkeypatch) -> None:
    from sysx.machine.disk_cache import disk_path, load_or_measure_disk

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def probe(directory: str, engine: str) -> dict:  # stands in for sysx.optim.nvme.probe.measure_disk
        calls.append(directory)
        return {"read_Bps": 3e9, "write_Bps": 2e9, "direct": True, "engine": "threads", "free_bytes": 1}

    first, reused = load_or_measure_disk(str(tmp_path), measure=probe)
    assert not reused and (first.read_bytes_per_s, first.write_bytes_per_s) == (3e9, 2e9)
    assert first.free_bytes is not None and first.free_bytes > 1  # read now, not the probe's figure
    (tmp_path / "other").mkdir()
    again, reused = load_or_measure_disk(str(tmp_path / "other"), measure=probe)  # same drive: cached
    assert reused and again.read_bytes_per_s == 3e9 and calls == [str(tmp_path)]
    load_or_measure_disk(str(tmp_path), measure=probe, refresh=True)
    assert len(calls) == 2
    assert disk_path(str(tmp_path)) != disk_path(str(tmp_path), "aio")
    with pytest.raises(FileNotFoundError, match="optim.nvme_dir="):
        load_or_measure_disk(str(tmp_path / "missing"), measure=probe)


def _job(*overrides: str):
    from sysx.config import load_config

    return load_config(["schedule=sysx", "device=cpu", *overrides])


def test_preflight_counts_the_state_files_and_refuses_a_full_disk(tmp_path, monkeypatch) -> None:
    from sysx import preflight
    from sysx.config import ConfigError
    from sysx.machine import disk_cache

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _job("optim.offload=nvme", f"optim.nvme_dir={tmp_path}")
    line = preflight.check_pipeline(cfg, 2)
    assert "state files" in line and f"free in {tmp_path}," in line  # no disk figures cached: none measured
    monkeypatch.setattr(disk_cache, "disk_path", lambda directory, engine: tmp_path / "disk.json")
    (tmp_path / "disk.json").write_text('{"read_Bps": 1e6, "write_Bps": 5e5, "direct": true, "engine": "threads"}')
    assert "s per step at read 0.001 GB/s, write 0.0005 GB/s (measured: threads, O_DIRECT)" in preflight.check_pipeline(
        cfg, 2
    )
    monkeypatch.setattr(disk_cache, "free_disk_bytes", lambda directory: 4096)
    with pytest.raises(ConfigError, match=f"optim.nvme_dir={tmp_path} has 4.0 KiB free") as err:
        preflight.check_pipeline(cfg, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="optim.nvme_dir=.*(is not a directory|no such directory)"):
        preflight.check_pipeline(_job("optim.offload=nvme", f"optim.nvme_dir={tmp_path}/none"), 2)


def test_preflight_host_refusal_names_what_the_tier_would_need(monkeypatch) -> None:
    from sysx import preflight
    from sysx.memory.budget import HostCapacity, HostMemoryError
    from sysx.optim import rollback_choice

    monkeypatch.setattr(rollback_choice, "probe_host", lambda: HostCapacity(1 << 40, 1 << 40, 1 << 20, None))
    with pytest.raises(HostMemoryError) as err:
        preflight.check_pipeline(_job(), 2)
    text = str(err.value)
    assert "host RAM: need" in text and "optim.offload=nvme optim.nvme_dir=" in text
    assert text.index("optim.offload=nvme") < text.index("\n\nPlan:")


def test_sysx_plan_prints_the_tier_section(capsys) -> None:
    from sysx.plan_command import main

    flags = ["--model", "tiny", "--ranks", "2", "--offload", "nvme", "--disk-read-gbps", "1"]
    assert main([*flags, "--disk-write-gbps", "0.5", "--disk-gb", "10", "--host-gb", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("NVMe tier")))
    assert "read 1 GB/s, write 0.5 GB/s (assumed), 10.0 GiB free" in out[head]
    assert out[head + 1].startswith("  node 0: state files ") and "without the tier" in out[head + 1]
    assert "exposed I/O per step (busiest node): disk " in out[head + 2] and "% of the step" in out[head + 2]
    assert "the disk hides behind compute from a global batch of " in out[head + 3] and "(planned: 4)" in out[head + 3]
    assert (
        "largest model whose training state fits a node of 16.0 GiB host memory and 10.0 GiB free disk: "
        in out[head + 4]
    )


def test_sysx_plan_json_carries_the_tier_figures(capsys) -> None:
    import json

    from sysx.optim.nvme.cost import step_io
    from sysx.plan_command import main

    flags = ["--model", "tiny", "--ranks", "2", "--offload", "nvme", "--disk-read-gbps", "1", "--json"]
    assert main(flags) == 0
    got = json.loads(capsys.readouterr().out)
    tier = got["nvme"]
    assert tier["step_s"] == got["iteration"] and tier["read_bytes_per_s"] == tier["write_bytes_per_s"] == 1e9
    node = tier["nodes"][0]
    bound = step_io(node["step_io"], node["step_io"], DiskRates(1e9, 1e9), got["iteration"])
    # the exposed I/O is the disk lane's replay of the step; the whole-step model is its lower bound
    assert tier["exposed_s"] == tier["replayed_exposed_s"] >= bound.exposed_s > 0
    assert tier["hides_from_global_batch"] > 4


def test_sysx_plan_tier_needs_rates_and_a_model(capsys) -> None:
    from sysx.plan_command import main

    assert main(["--model", "tiny", "--offload", "nvme"]) == 2
    assert "--offload nvme needs --nvme-dir DIR" in capsys.readouterr().err
    assert main(["--offload", "nvme", "--disk-read-gbps", "3"]) == 2
    assert "needs a model" in capsys.readouterr().err


def test_plan_single_prints_the_tier_lines(capsys) -> None:
    from sysx.single.plan_cmd import main

    base = ["--model", "tiny", "--precision", "bf16", "--hardware", "rtx4090", "--host-gb", "8"]
    assert main([*base, "--offload", "nvme", "--disk-read-gbps", "1", "--disk-gb", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("NVMe tier")))
    assert out[head] == "NVMe tier (optim.offload=nvme), the drives: read 1 GB/s, write 1 GB/s (assumed), 4.0 GiB free"
    assert out[head + 1].startswith("  state files ") and "(without the tier " in out[head + 1]
    assert "does not fit" not in out[head + 1]
    assert out[head + 2].startswith("  exposed I/O per step: disk ")
    assert "(planned: 16)" in out[head + 3]
    assert (
        "largest model whose training state fits a node of 8.0 GiB host memory and 4.0 GiB free disk" in out[head + 4]
    )
    assert main(base) == 0 and "NVMe tier" not in capsys.readouterr().out
    assert main([*base, "--offload", "nvme", "--disk-read-gbps", "1", "--disk-gb", "0.001"]) == 0
    assert "(does not fit: 1.0 MiB free)" in capsys.readouterr().out


def test_the_hiding_batch_falls_back_to_one_more_micro_batch_then_says_why() -> None:
    from types import SimpleNamespace

    from sysx.plan_nvme import _grown

    def replan(limit: int):
        def at(m: int):
            if m > limit:
                raise ValueError(f"needs more GPU memory at {m}\nsecond line")
            return None, SimpleNamespace(iteration=float(m)), None  # (schedule, timeline, costs)

        return at

    assert _grown(replan(99), 4) == ((8, 8.0), None)
    assert _grown(replan(5), 4) == ((5, 5.0), None)  # twice does not fit the GPUs, one more does
    assert _grown(replan(4), 4) == (None, "the plan at 5 micro-batches fails: needs more GPU memory at 5")


def test_the_window_plans_the_tier_per_group_not_the_whole_model_as_one_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window trainer's rollback check plans host memory from its groups (every block, the
    embedding+head): with the tier its staging pools hold the largest group, so the tier needs less
    RAM than host-memory states. Planned as one whole-model stage, a 1B window was refused for 40 GiB
    it runs in 9."""
    from types import SimpleNamespace

    from sysx.model import get_preset
    from sysx.trainers import single as single_mod

    plans: list[int] = []

    def record(requested, plan, capacity=None, disk_free=None):
        plans.append(plan(requested).total)
        return requested, ""

    monkeypatch.setattr(single_mod, "choose_rollback", record)
    cfg = get_preset("llama2_7b")
    for offload in ("host", "nvme"):
        trainer = SimpleNamespace(
            model_cfg=cfg,
            dtype=torch.bfloat16,
            cfg=SimpleNamespace(optim=SimpleNamespace(offload=offload, nvme_dir=None)),
        )
        single_mod.SingleTrainer._choose_rollback(trainer, "undo")
    host, nvme = plans
    assert nvme < host / 2, plans
