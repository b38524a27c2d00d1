"""``sysx plan``: JSON numbers, tables, pictures, config files and errors."""

from __future__ import annotations

import json

import pytest

from sysx import cli
from sysx.schedule.plan import main


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
    data = _json(capsys, ["--compare", "all", "--t-opt", "6"] + FIG)
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


def test_config_file_and_cli_dispatch(tmp_path, capsys) -> None:
    cfg = tmp_path / "plan.yaml"
    cfg.write_text("plan:\n  schedule: mobius\n  ranks: 4\n  microbatches: 4\n  stages: 8\n  t-opt: 6\n")
    assert _json(capsys, ["--config", str(cfg)])["iteration"] == 45.0
    assert _json(capsys, ["--config", str(cfg), "--t-opt", "0"])["iteration"] == 33.0  # flags override
    assert cli.main(["plan", "--schedule", "sysx", "--json"] + FIG) == 0
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
