"""``sysx plan``: JSON numbers, tables, pictures, config files and errors."""

from __future__ import annotations

import json

import pytest

from sysx import cli
from sysx.config import load_config
from sysx.plan_command import main
from sysx.runtime.options import options_from_config


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


FIG = ["--ranks", "4", "--microbatches", "4", "--stages", "8", "--t-fwd", "1", "--t-bwd", "2"]


def test_json_reproduces_figures_2_and_8(capsys) -> None:
    sysx = _json(capsys, ["--schedule", "sysx", "--split", "2", "--t-opt", "6"] + FIG)
    assert sysx["iteration"] == 30.0 and sysx["bubble_ratio"] == pytest.approx(0.2) and sysx["busy"] == [24.0] * 4
    mob = _json(capsys, ["--schedule", "mobius", "--t-opt", "6"] + FIG)
    assert mob["iteration"] == 45.0 and mob["bubble_ratio"] == pytest.approx(21 / 45)
    gp = _json(capsys, ["--schedule", "gpipe", "--ranks", "4", "--microbatches", "4"])
    assert gp["bubble_ratio"] == pytest.approx(3 / 7)


def test_table_output_and_op_lists(capsys) -> None:
    assert main(["--schedule", "sysx", "--split", "2", "--t-opt", "6", "--ops"] + FIG) == 0
    out = capsys.readouterr().out
    assert "rank 0 (" in out and "F s0 mb0" in out and "B s7.1 mb0" in out and "SEND_CKPT" in out
    assert "iteration 30" in out and "bubble ratio 20.00%" in out and "no deadlock" in out


def test_compare_and_pictures(tmp_path, capsys) -> None:
    png, trace = tmp_path / "cmp.png", tmp_path / "cmp.json"
    assert main(["--compare", "ablation", "--t-opt", "6", "--png", str(png), "--trace", str(trace)] + FIG) == 0
    out = capsys.readouterr().out
    for line in ("mobius", "sysx CFG0", "sysx CFG3"):
        assert line in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert json.loads(trace.read_text())["traceEvents"]
    data = _json(capsys, ["--compare", "all", "--split", "2", "--t-opt", "6"] + FIG)  # Figure 8's d
    its = {d["schedule"]: d["iteration"] for d in data["compare"]}
    # gpipe / 1f1b run the same model as 4 stages of twice the cost
    assert its == {"gpipe": 54.0, "1f1b": 54.0, "interleaved_1f1b": 45.0, "mobius": 45.0, "sysx": 30.0}


def test_model_mode_with_a_preset(capsys) -> None:
    data = _json(
        capsys,
        [
            "--model",
            "tiny",
            "--ranks",
            "2",
            "--microbatches",
            "4",
            "--stages",
            "3",
            "--split",
            "2",
            "--seq-len",
            "64",
            "--micro-batch-size",
            "2",
        ],
    )
    assert data["unit"] == "s" and data["iteration"] > 0 and len(data["peak_gpu"]) == 2
    assert main(["--model", "tiny", "--ranks", "2", "--stages", "2", "--split", "1", "--stage-sizes", "3,3"]) == 0
    assert "partition of tiny" in capsys.readouterr().out


def test_plan_from_the_training_hydra_config(capsys) -> None:
    data = _json(
        capsys,
        [
            "--ranks",
            "2",
            "--stages",
            "3",
            "--hydra",
            "model=tiny",
            "train.micro_batches=3",
            "train.seq_len=64",
            "train.micro_batch_size=2",
        ],
    )
    assert data["unit"] == "s" and data["schedule"] == "sysx" and data["ranks"] == 2
    assert (
        main(
            [
                "--ranks",
                "2",
                "--stages",
                "3",
                "--microbatches",
                "5",
                "--ops",
                "--hydra",
                "model=tiny",
                "train.micro_batches=3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "F s0 mb4" in out and "partition of tiny" in out  # the flag wins over train.micro_batches
    assert main(["--hydra", "model=nope"]) == 2
    assert "model" in capsys.readouterr().err


def test_the_default_layout_is_the_one_sysx_train_runs(capsys) -> None:
    """Without --stages / --split, ``sysx plan`` plans the runtime's preferred layout
    (:meth:`PipelineOptions.candidates`), per schedule and ablation config, and from a Hydra config."""
    for argv, overrides in (
        ([], []),
        (["--cfg", "1"], ["schedule.cfg=1"]),
        (["--cfg", "0"], ["schedule.cfg=0"]),
        (["--schedule", "mobius"], []),
    ):
        job = load_config(["schedule=" + ("mobius" if "mobius" in argv else "sysx"), *overrides])
        nsf, d = options_from_config(job).candidates(4)[0]
        data = _json(capsys, argv)
        assert (data["stages"], data["split"]) == (nsf, d), argv
    assert _json(capsys, [])["split"] == 3  # the paper's evaluated setting (sysx.runtime.options.BALANCED_SPLIT)
    data = _json(capsys, ["--hydra", "model=llama2_7b", "schedule=sysx", "schedule.stages_per_rank=1"])
    assert (data["stages"], data["split"]) == (4, 3)
    # with a model of 12 flat layers a rank and no layout keys, one Block per stage (block_stages)
    data = _json(capsys, ["--ranks", "2", "--hydra", "model=llama2_7b", "schedule=sysx"])
    assert (data["stages"], data["split"]) == (33, 1)
    compared = {(d["schedule"], d["cfg"]): d["split"] for d in _json(capsys, ["--compare", "ablation"])["compare"]}
    assert compared == {("mobius", None): 1, ("sysx", 0): 1, ("sysx", 1): 2, ("sysx", 2): 3, ("sysx", 3): 3}


EMULATED = ["device=emulated", "emulate.model=llama2_7b", "train.seq_len=16", "train.micro_batch_size=2"]


def test_an_emulated_config_plans_the_emulated_cluster(capsys) -> None:
    """``--hydra device=emulated``: the plan the emulated run is timed against (the emulated preset's
    costs on the emulated cluster, the schedule the run builds), not the small stand-in model's."""
    from sysx.emulate import emulated_model, plan_emulation
    from sysx.runtime.options import make_schedule

    data = _json(capsys, ["--ranks", "2", "--hydra", *EMULATED, "train.micro_batches=4"])
    job = load_config([*EMULATED, "train.micro_batches=4"])
    model = emulated_model(job)
    sched = make_schedule(
        options_from_config(job),
        model.config,
        n_ranks=2,
        n_micro=4,
        seq_len=model.seq_len,
        micro_batch_size=job.train.micro_batch_size,
    )
    assert sched.options.backward_parts == 2  # the block layout's default at 2 sequences a micro-batch
    plan = plan_emulation(job, sched, backend=job.optim.backend).timeline
    assert data["iteration"] == pytest.approx(plan.iteration) and data["peak_gpu"] == pytest.approx(plan.peak_gpu)
    assert data["iteration"] > 0.1 and max(data["peak_gpu"]) > 2**30  # llama2_7b's stages, not the tiny model's
    assert "llama2_7b at 2x16 tokens per micro-batch" in data["emulated"] and data["split"] == 1  # a block a stage
    assert main(["--ranks", "2", "--compare", "mobius,sysx", "--hydra", *EMULATED]) == 0
    out = capsys.readouterr().out
    assert out.startswith("emulated: v100") and "mobius" in out and "sysx CFG3" in out
    assert main(["--ranks", "2", "--hydra", *EMULATED, "emulate.gpu=rtx4090", "emulate.seq_len=65536"]) == 2
    assert "needs" in capsys.readouterr().err  # the run would be refused: the emulated GPU's memory overflows


def test_config_file_and_cli_dispatch(tmp_path, capsys) -> None:
    cfg = tmp_path / "plan.yaml"
    cfg.write_text("plan:\n  schedule: mobius\n  ranks: 4\n  microbatches: 4\n  stages: 8\n  t-opt: 6\n")
    assert _json(capsys, ["--config", str(cfg)])["iteration"] == 45.0
    assert _json(capsys, ["--config", str(cfg), "--t-opt", "0"])["iteration"] == 33.0  # flags override
    assert cli.main(["plan", "--schedule", "sysx", "--split", "2", "--json"] + FIG) == 0
    assert json.loads(capsys.readouterr().out)["iteration"] == 27.0


def test_errors_are_clear(tmp_path, capsys) -> None:
    assert main(["--schedule", "gpipe", "--ranks", "4", "--stages", "8"]) == 2
    assert "use 4 stages, or schedule 'mobius'" in capsys.readouterr().err
    assert main(["--schedule", "sysx", "--ranks", "4", "--stages", "2"]) == 2
    assert "Nsf >= Ng" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rankz: 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "unknown option(s) ['rankz']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--compare", "nope"])
