"""Configuration: composition of conf/, overrides, the schema, and one-line errors with exit status 2."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_runtime_procs import child_pythonpath

from sysx.config import (
    ConfigError,
    SysxConfig,
    compose_config,
    config_dir,
    from_yaml,
    group_options,
    load_config,
    model_config,
    resolve,
    to_yaml,
)
from sysx.config.compose import _keys_of, _schema_node
from sysx.model import PRESETS
from sysx.train import TRAINERS, main, parse_argv

ROOT = Path(__file__).resolve().parents[1]


def test_config_dir_is_the_checkout_conf() -> None:
    assert config_dir() == ROOT / "conf"
    assert (config_dir() / "config.yaml").is_file()


def test_default_config_composes_and_matches_the_dataclass_defaults() -> None:
    cfg = load_config([])
    assert cfg.schedule.name == "auto"
    assert cfg.model.preset == "tiny"
    assert cfg.precision == "auto" and cfg.device == "auto" and cfg.data.name == "default"
    assert cfg.run_dir.startswith("runs/") and "$" not in cfg.run_dir  # ${now:...} resolved
    # conf/*.yaml and the dataclass defaults must not drift apart (library users get the same job).
    defaults = dataclasses.replace(SysxConfig(), run_dir=cfg.run_dir)
    assert cfg == defaults


def test_overrides_reach_the_typed_config() -> None:
    cfg = load_config(
        [
            "train.steps=7",
            "train.micro_batch_size=3",
            "train.micro_batches=5",
            "train.seq_len=32",
            "precision=bf16",
            "seed=11",
            "run_dir=/tmp/somewhere",
            "optim.lr=0.01",
            "optim.betas=[0.8,0.9]",
            "log.progress=false",
            "model.n_layers=1",
            "eval.every=0",
        ]
    )
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.micro_batches, cfg.train.seq_len) == (7, 3, 5, 32)
    assert (cfg.precision, cfg.seed, cfg.run_dir, cfg.optim.lr, cfg.optim.betas) == (
        "bf16",
        11,
        "/tmp/somewhere",
        0.01,
        [0.8, 0.9],
    )
    assert cfg.log.progress is False and cfg.eval.every == 0
    assert cfg.tokens_per_step == 3 * 5 * 32
    mcfg = model_config(cfg)
    assert mcfg.n_layers == 1 and mcfg.dim == PRESETS["tiny"].dim


def test_every_preset_has_a_group_entry_and_back() -> None:
    assert set(group_options("model")) == set(PRESETS)
    for name in PRESETS:
        cfg = load_config([f"model={name}"])
        assert model_config(cfg) == PRESETS[name]


def test_every_schedule_entry_has_a_trainer() -> None:
    assert group_options("schedule") == sorted(TRAINERS)
    for name in group_options("schedule"):
        assert load_config([f"schedule={name}"]).schedule.name == name


def test_resolve_fills_run_dir_for_python_built_configs() -> None:
    cfg = resolve(SysxConfig())
    assert cfg.run_dir.startswith("runs/") and "$" not in cfg.run_dir
    assert dataclasses.replace(cfg, run_dir=SysxConfig().run_dir) == SysxConfig()


def test_yaml_round_trip() -> None:
    cfg = load_config(["train.steps=9", "precision=fp16"])
    assert from_yaml(to_yaml(cfg)) == cfg


BAD = [
    # (overrides, words the one-line message must contain)
    (["precision=fp8"], ["precision=fp8", "fp32, bf16, fp16"]),
    (["train.steps=-1"], ["train.steps=-1", ">= 1"]),
    (["train.steps=0"], ["train.steps=0", ">= 1"]),
    (["schedule=nosuch"], ["schedule=nosuch", "reference"]),
    (["model=nosuch"], ["model=nosuch", "tiny", "llama2_7b"]),
    (["train.micro_batch_size=abc"], ["train.micro_batch_size=abc", "integer"]),
    (["train.steps=2.5"], ["train.steps=2.5", "integer"]),
    (["log.progress=maybe"], ["log.progress=maybe", "true or false"]),
    (["optim.betas=[0.9,x]"], ["optim.betas", "list of numbers"]),
    (["optim.betas=[0.9,1.5]"], ["optim.betas", "[0, 1)"]),
    (["foo=1"], ["'foo'", "train", "precision"]),
    (["+foo=1"], ["'foo'", "train", "precision"]),
    (["train.nosuch=1"], ["'train.nosuch'", "micro_batch_size"]),
    (["~train.steps"], ["train.steps", "removing"]),
    (["train=3"], ["train=3", "steps"]),
    (["device=tpu"], ["device=tpu", "cpu", "cuda"]),
    (["optim=sgd"], ["optim=sgd", "adamw"]),
    (["optim.min_lr=1.0"], ["optim.min_lr=1.0", "optim.lr"]),
    (["optim.lr=2e-5", "optim.min_lr=1e-4"], ["optim.min_lr=0.0001", "optim.lr=2e-05"]),
    (["optim.min_lr_ratio=2"], ["optim.min_lr_ratio=2", "between 0 and 1"]),
    (["optim.grad_clip=-1"], ["optim.grad_clip=-1", ">= 0"]),
    (["loss_scale.backoff=2"], ["loss_scale.backoff=2", "(0, 1)"]),
    (["log.every=0"], ["log.every=0", ">= 1"]),
    (["data=file"], ["data.path", "data=file"]),
    (["data=nosuch"], ["data=nosuch", "default, file"]),
    (["model.preset=nosuch"], ["model.preset=nosuch", "tiny"]),
    (["model.n_heads=3"], ["model.n_heads=3", "model.dim"]),
    (["train.seq_len=100000"], ["train.seq_len=100000", "max_seq_len"]),
    (["schedule.name=nosuch"], ["schedule.name=nosuch", "reference"]),
    (["train.steps=1,2"], ["train.steps=1,2", "one value"]),
    (["nokey"], ["nokey", "key=value"]),
    (["parallel.bind_cores=maybe"], ["parallel.bind_cores=maybe", "auto, true or false"]),
    (["schedule=single", "parallel.bind_cores=true"], ["parallel.bind_cores=True", "no ranks to pin"]),
]


@pytest.mark.parametrize(("overrides", "words"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_gives_one_line_naming_key_value_and_allowed(
    overrides: list[str], words: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    status = main([*overrides, f"run_dir={run_dir}"])
    _, err = capsys.readouterr()
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sysx-train: error: ")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not run_dir.exists()


def test_min_lr_follows_lr_unless_given() -> None:
    """The README's fine-tune (``optim.lr=2e-5``) composes: the decay's floor is a ratio of lr by default."""
    default = load_config([])
    assert default.optim.min_lr is None and default.optim.final_lr == pytest.approx(1e-4)
    fine_tune = load_config(["optim.lr=2e-5"])
    assert fine_tune.optim.final_lr == pytest.approx(2e-6)
    assert load_config(["optim.lr=2e-5", "optim.min_lr_ratio=0"]).optim.final_lr == 0.0
    assert load_config(["optim.lr=2e-5", "optim.min_lr=1e-6"]).optim.final_lr == 1e-6


def test_config_error_from_the_library_api() -> None:
    with pytest.raises(ConfigError, match=r"precision=fp8 is not valid: allowed: auto, fp32, bf16, fp16"):
        load_config(["precision=fp8"])
    with pytest.raises(ConfigError, match="train.micro_batches=0"):
        load_config(["train.micro_batches=0"])


@pytest.mark.parametrize(
    ("override", "word"), [("precision=fp8", "fp32, bf16, fp16"), ("schedule=nosuch", "reference")]
)
def test_bad_value_from_the_command_line(override: str, word: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(os.environ)}
    proc = subprocess.run(
        [sys.executable, "-m", "sysx.train", override],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert override in lines[0] and word in lines[0]
    assert list(tmp_path.iterdir()) == []  # no outputs/, no run_dir, nothing


def test_argv_parsing() -> None:
    inv = parse_argv(["train.steps=3", "--local-rank=1", "--local_rank", "2", "model=tiny", "--cfg", "job"])
    assert inv.overrides == ["train.steps=3", "model=tiny"] and inv.show_cfg and not inv.help
    assert parse_argv(["--help"]).help
    with pytest.raises(ConfigError, match="unknown option '--verbose'"):
        parse_argv(["--verbose"])
    with pytest.raises(ConfigError, match="--cfg hydra"):
        parse_argv(["--cfg", "hydra"])


def test_cfg_job_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "job", "train.steps=13", "precision=bf16"]) == 0
    out = capsys.readouterr().out
    printed = OmegaConf.create(out)
    assert printed.train.steps == 13 and printed.precision == "bf16" and printed.schedule.name == "auto"


def test_help_lists_groups_and_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: sysx-train" in out
    for word in ("llama2_110b", "reference", "adamw", "file", "micro_batches", "grad_clip", "run_dir"):
        assert word in out


def test_compose_creates_nothing_and_keeps_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    compose_config(["train.steps=3"])
    assert Path.cwd() == tmp_path
    assert list(tmp_path.iterdir()) == []


IGNORED = [
    # (overrides, words the one-line refusal must contain: the key, the schedule, the fix)
    (["schedule=gpipe", "schedule.split=2"], ["schedule.split=2", "for gpipe", "schedule=sysx"]),
    (["schedule=sysx", "schedule.cfg=0", "schedule.split=2"], ["schedule.split=2", "schedule.cfg=0", "cfg=1, 2 or 3"]),
    (["schedule=mobius", "schedule.cfg=1"], ["schedule.cfg=1", "for mobius", "schedule=sysx"]),
    (["schedule=1f1b", "schedule.stages_per_rank=2"], ["schedule.stages_per_rank=2", "for 1f1b", "interleaved_1f1b"]),
    (["schedule=interleaved_1f1b", "schedule.cfg=2"], ["schedule.cfg=2", "for interleaved_1f1b", "schedule=sysx"]),
    (["schedule=reference", "schedule.split=2"], ["schedule.split=2", "for reference", "gpipe"]),
    (["schedule=single", "schedule.param_buffers=3"], ["schedule.param_buffers=3", "for single", "sysx"]),
    (["schedule=sysx", "single.window=2"], ["single.window=2", "for sysx", "schedule=single"]),
    (["schedule=gpipe", "single.policy=pyao"], ["single.policy=pyao", "for gpipe", "schedule=single"]),
    # auto with one process resolves to single, which reads no pipeline key
    (["schedule=auto", "schedule.stage_sizes=[3,3]"], ["schedule.stage_sizes=[3, 3]", "for single", "sysx"]),
]


@pytest.mark.parametrize(("overrides", "words"), IGNORED, ids=[" ".join(o) for o, _ in IGNORED])
def test_a_key_the_schedule_ignores_is_refused_in_one_line(
    overrides: list[str],
    words: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in (
        "RANK",
        "WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMIX_RANK",
    ):
        monkeypatch.delenv(key, raising=False)  # one process
    run_dir = tmp_path / "run"
    status = main([*overrides, "device=cpu", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sysx-train: error: ") and "ignored" in lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not run_dir.exists()


def test_keys_the_schedule_reads_pass() -> None:
    load_config(["schedule=sysx", "schedule.split=2", "schedule.cfg=1", "schedule.stages_per_rank=2"])
    load_config(["schedule=gpipe", "schedule.stages_per_rank=1", "schedule.param_buffers=3", "schedule.timeout_s=10"])
    load_config(["schedule=single", "single.window=2", "single.policy=matmuls"])
    load_config(["schedule=auto", "single.window=2"])  # checked once auto is resolved
    load_config(["schedule=auto", "schedule.split=2"])


def test_pipeline_options_refuse_what_their_schedule_ignores() -> None:
    from sysx.runtime import PipelineOptions, RuntimeConfigError

    with pytest.raises(
        RuntimeConfigError, match=r"^schedule.split=2 is not valid for gpipe: .*ignored; .*schedule=sysx$"
    ):
        PipelineOptions(schedule="gpipe", split=2).check()
    with pytest.raises(RuntimeConfigError, match=r"schedule.cfg=5 is not valid: allowed: 0, 1, 2, 3"):
        PipelineOptions(schedule="sysx", cfg=5).check()
    with pytest.raises(
        RuntimeConfigError, match=r"optim.rollback=no is not valid: allowed: undo, snapshot, exact, auto"
    ):
        PipelineOptions(rollback="no").check()
    PipelineOptions(schedule="sysx", split=2, cfg=1).check()
    with pytest.raises(RuntimeConfigError, match=r"^schedule.keep_activations=True is not valid for sysx: .*gpipe"):
        PipelineOptions(schedule="sysx", keep_activations=True).check()
    PipelineOptions(schedule="1f1b", keep_activations=True).check()


def test_single_section_checks_itself() -> None:
    from sysx.config import SingleSection

    for bad, words in (
        (SingleSection(window=-1), "single.window=-1"),
        (SingleSection(policy="7"), "level 0..4"),
        (SingleSection(hardware="tpu"), "measure, remeasure, rtx4090"),
        (SingleSection(optimizer_overlap="x"), "backward"),
    ):
        with pytest.raises(ConfigError, match=words):
            bad.validate()
    SingleSection(policy="3", hardware="h100").validate()


def test_config_imports_without_torch() -> None:
    code = "import sys, sysx.config; sys.exit(1 if 'torch' in sys.modules else 0)"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(os.environ)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_every_key_a_message_or_a_document_suggests_is_in_the_config() -> None:
    """An error's fix, a comment or a document that tells the user to set ``section.key=value``
    names a key the config has (the window's replay error once said ``single.save_level=input``)."""
    sections = [s for s in _keys_of("") if dataclasses.is_dataclass(_schema_node(s))]
    suggested = re.compile(rf"(?<![\w./-])((?:{'|'.join(sections)})\.[a-z_][a-z0-9_.]*)=")
    files = [*(ROOT / "sysx").rglob("*.py"), *(ROOT / "conf").rglob("*.yaml"), *(ROOT / "docs").rglob("*.md")]
    files += [ROOT / "README.md", ROOT / "profiling" / "README.md"]
    unknown = sorted(
        f"{m.group(1).rstrip('.')} ({path.relative_to(ROOT)}:{line})"
        for path in files
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for m in suggested.finditer(text)
        if _schema_node(m.group(1).rstrip(".")) is None
    )
    assert len(files) > 100 and not unknown, unknown
