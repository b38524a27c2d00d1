"""The bad-input matrix: every input a user can get wrong ends in exit 2 and ONE line naming the key,
the value and the fix, before anything is allocated or written; no file, segment or process is left.

Most inputs run in-process through ``sysx.train.main`` / ``sysx.cli.main`` (fast); a few through a
real subprocess, one under torchrun with 2 ranks (the line once, no traceback).
``python tests/test_bad_inputs.py`` prints the matrix as "input -> line".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
from test_runtime_procs import child_pythonpath

from sysx.data import SampleWriter, TokenWriter

SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[1]

# (overrides, substrings the one line must contain: the key/value and the fix). "{d}" is the data folder.
TRAIN_CASES: list[tuple[str, list[str]]] = [
    # the list
    ("run_dir={d}/afile", ["run_dir=", "afile", "existing file", "set run_dir"]),
    ("run_dir={d}/afile/sub", ["run_dir=", "which is a file", "set run_dir"]),
    ("run_dir=/proc/sysx-run", ["run_dir=/proc/sysx-run", "not writable", "set run_dir"]),
    (
        "data=file data.path={d}/raw/train.bin data.dtype=uint32 data.vocab_size=256",
        ["data.dtype=uint32", "set data.dtype=uint16"],
    ),
    ("data.path={d}/raw/train.bin", ["data.path=", "add data=file"]),
    (
        "data=file data.path={d}/samples/chat.bin train.seq_len=16",
        ["40 tokens", "train.seq_len=16", "set train.seq_len>=39", "--max-tokens 17"],
    ),
    (
        "data=file data.path={d}/raw/train.bin data.dtype=uint16 data.vocab_size=100",
        ["data.vocab_size=100", "ids reach 240", "data.vocab_size=241"],
    ),
    ("data=file data.path={d}/odd/train.bin data.dtype=uint32 data.vocab_size=256", ["data.dtype=uint32", "odd count"]),
    (
        "data=file data.path={d}/tiny/train.bin data.dtype=uint32 data.vocab_size=256",
        ["data.dtype=uint32 is wrong", "try data.dtype=uint16"],
    ),
    (
        "data=file data.path={d}/odd/train.bin data.dtype=uint16 data.vocab_size=256",
        ["data.dtype=uint16", "odd count", "truncated"],
    ),
    ("data=file data.path={d}/trunc/tokens.bin", ["tokens.meta.json", "truncated", "sysx data prepare"]),
    ("data=file data.path={d}/raw/train.bin", ["no metadata", "data.dtype=uint16"]),
    ("schedule=single model=llama2_110b device=cpu", ["this machine has", "GiB", "smaller model"]),
    (
        "schedule=single model=llama2_7b device=cpu single.host_memory_gb=100000",
        ["single.host_memory_gb=100000", "free host memory", "or 0"],
    ),
    (
        "--check --ranks 4 schedule=sysx model.n_layers=1",
        ["needs at least 4 forward stages (one per rank)", "fewer processes", "!stages_per_rank"],
    ),
    (
        "--check --ranks 2 schedule=sysx model.n_layers=1 schedule.stages_per_rank=2",
        ["needs 4 forward stages", "lower schedule.stages_per_rank"],
    ),
    (
        "--check --ranks 3 schedule=sysx parallel.replicas=2",
        ["parallel.replicas=2 does not divide the 3 processes", "a multiple of 2 processes"],
    ),
    ("--check --ranks 0", ["--ranks 0", ">= 1"]),
    ("--ranks x --check", ["--ranks x", "integer"]),
    ("schedule=sysx model=llama2_110b device=cpu", ["host memory the job needs", "need", "Fix"]),
    # data files: missing, empty, corrupt, mismatched
    ("data=file data.path={d}/nope.bin", ["token file not found", "sysx data prepare"]),
    (
        "data=file data.path={d}/empty/train.bin data.dtype=uint16 data.vocab_size=256",
        ["is empty", "sysx data prepare"],
    ),
    ("data=file data.path={d}/badmeta/tokens.bin", ["cannot read token metadata", "tokens.meta.json"]),
    (
        "data=file data.path={d}/u32/train.bin data.dtype=uint16 data.vocab_size=256",
        ["data.dtype=uint16", "set data.dtype=uint32"],
    ),
    (
        "data=file data.path={d}/trunc/tokens.bin data.dtype=uint32",
        ["data.dtype=uint32 contradicts", "set data.dtype=uint16"],
    ),
    ("data=file data.path={d}/corrupt/tokens.bin", ["ids up to", "says vocab_size=256", "corrupt"]),
    (
        "data=file data.path={d}/tiny/train.bin data.dtype=uint16 data.vocab_size=256 eval.every=10",
        ["too few to carve", "eval.every=0"],
    ),
    ("schedule=reference model.vocab_size=100", ["model.vocab_size=100", "model.vocab_size=256"]),
    ("model.init_from={d}/nope", ["model.init_from=", "does not exist"]),
    (
        "model.init_from={d}/hf_truncated",
        ["model.init_from=", "model.safetensors is not a complete safetensors file", "download or copy it again"],
    ),
    ("model.init_from={d}/hf_noconfig", ["model.init_from=", "has no config.json", "!train.resume"]),
    (
        "model.init_from={d}/hf_tokenizer",
        ["model.init_from=", "data=default", "sysx data prepare", "--tokenizer", "data.path="],
    ),
    ("train.resume={d}/nope", ["train.resume=", "no such file or folder", "auto or none"]),
    (
        "train.micro_batch_size=100000000 schedule=reference",
        ["train.micro_batch_size=100000000 cannot fit", "host memory", "set train.micro_batch_size <="],
    ),
    ("train.micro_batch_size=100000000", ["cannot fit", "schedule=single samples a whole step"]),
    # every section: a wrong type and an out-of-range value
    ("train.steps=abc", ["train.steps=abc", "integer"]),
    ("train.steps=0", ["train.steps=0", ">= 1"]),
    ("train.seq_len=-1", ["train.seq_len=-1", ">= 1"]),
    ("train.micro_batch_size=0", ["train.micro_batch_size=0", ">= 1"]),
    ("train.micro_batches=x", ["train.micro_batches=x", "integer"]),
    ("optim.lr=abc", ["optim.lr=abc", "number"]),
    ("optim.lr=-1", ["optim.lr=-1", "> 0"]),
    ("optim.betas=[2,0.9]", ["optim.betas=", "[0, 1)"]),
    ("optim.eps=0", ["optim.eps=0", "> 0"]),
    ("optim.weight_decay=-1", ["optim.weight_decay=-1", ">= 0"]),
    ("optim.decay_norms=maybe", ["optim.decay_norms=maybe", "true or false"]),
    ("optim.warmup_steps=-1", ["optim.warmup_steps=-1", ">= 0"]),
    ("optim.min_lr=-1", ["optim.min_lr=-1", "between 0 and optim.lr"]),
    ("optim.grad_clip=-1", ["optim.grad_clip=-1", ">= 0"]),
    ("optim.backend=nope", ["optim.backend=nope", "allowed"]),
    ("optim.rollback=nope", ["optim.rollback=nope", "allowed"]),
    ("optim.workers=0", ["optim.workers=0", ">= 1"]),
    ("precision=fp64", ["precision=fp64", "fp32, bf16, fp16"]),
    ("device=tpu", ["device=tpu", "allowed"]),
    ("seed=abc", ["seed=abc", "integer"]),
    ("eval.every=-1", ["eval.every=-1", ">= 0"]),
    ("eval.batches=0", ["eval.batches=0", ">= 1"]),
    ("log.every=0", ["log.every=0", ">= 1"]),
    ("model=nope", ["model=nope", "allowed"]),
    ("model.dim=0", ["model.dim=0", ">= 1"]),
    ("model.n_heads=3", ["model.n_heads=3", "must divide model.dim"]),
    ("model.norm_eps=0", ["model.norm_eps=0", "> 0"]),
    ("schedule=nope", ["schedule=nope", "allowed"]),
    ("schedule.timeout_s=0", ["schedule.timeout_s=0", "> 0"]),
    ("schedule=sysx schedule.cfg=7", ["schedule.cfg=7", "0, 1, 2, 3"]),
    ("schedule=sysx schedule.param_buffers=0", ["schedule.param_buffers=0", ">= 1"]),
    ("schedule=sysx schedule.stage_sizes=[1,1]", ["stage_sizes [1, 1]", "layer counts"]),
    ("data=nope", ["data=nope", "default, file"]),
    ("data=file", ["data.path=None", "data.path=/data/tokens.bin"]),
    ("data.dtype=int8", ["data.dtype=int8", "uint16, uint32"]),
    ("data=file data.path={d}/raw/train.bin data.dtype=uint16 data.vocab_size=0", ["data.vocab_size=0", ">= 1"]),
    ("loss_scale.init=0", ["loss_scale.init=0", "> 0"]),
    ("loss_scale.backoff=2", ["loss_scale.backoff=2", "(0, 1)"]),
    ("checkpoint.every=-1", ["checkpoint.every=-1", ">= 0"]),
    ("checkpoint.keep=0", ["checkpoint.keep=0", ">= 1"]),
    ("single.host_memory_gb=-1", ["single.host_memory_gb=-1", ">= 0"]),
    ("single.policy=nope", ["single.policy=nope", "allowed"]),
    ("single.hardware=nope", ["single.hardware=nope", "allowed"]),
    ("single.seq_chunk=-1", ["single.seq_chunk=-1", ">= 0", "divides train.seq_len"]),
    ("schedule=single single.seq_chunk=100", ["single.seq_chunk=100", "must divide train.seq_len=128"]),
    ("model.rope_type=yarn", ["model.rope_type=yarn", "not supported", "default", "llama3"]),
    ("model.rope_type=llama3", ["rope_type='llama3' needs", "rope_factor=8", "rope_original_max_len=8192"]),
    ("model.rope_factor=8", ["rope_factor set", "set rope_type='llama3'"]),
    ("model=llama3_1_8b model.rope_factor=0.5", ["rope_factor must be a number >= 1"]),
    ("device=emulated emulate.gpu=tpu", ["emulate.gpu=tpu", "allowed", "v100"]),
    ("device=emulated emulate.cpu=nope", ["emulate.cpu=nope", "epyc7452"]),
    ("device=emulated emulate.net=nope", ["emulate.net=nope", "pcie3_ib_hdr"]),
    ("device=emulated emulate.model=tiny", ["emulate.model=tiny", "llama2_10b"]),
    ("device=emulated emulate.time_scale=0", ["emulate.time_scale=0", "> 0"]),
    ("device=emulated emulate.seq_len=0", ["emulate.seq_len=0", ">= 1"]),
    ("device=emulated emulate.micro_batch_size=x", ["emulate.micro_batch_size=x", "integer"]),
    ("device=emulated emulate.warmup_steps=-1", ["emulate.warmup_steps=-1", ">= 0"]),
    ("device=emulated emulate.max_late=1", ["emulate.max_late=1", "(0, 1)"]),
    ("emulate.time_scale=0.5", ["emulate.time_scale=0.5", "add device=emulated"]),
    ("device=emulated model.n_layers=4", ["model.n_layers=4", "48 layers", "remove model.n_layers"]),
    ("device=emulated schedule=single", ["device=emulated", "schedule=sysx"]),
    (
        "device=emulated emulate.seq_len=4096 emulate.micro_batch_size=16",
        ["emulate.gpu=v100 has 32 GiB", "GiB on rank 0", "lower emulate.micro_batch_size"],
    ),
    ("profile.timeline_steps=[5,2]", ["profile.timeline_steps=[5, 2]", "0 <= first <= last", "or null"]),
    ("profile.timeline_steps=[3]", ["profile.timeline_steps=[3]", "[first,last]"]),
    ("profile.nsys_steps=[-1,2]", ["profile.nsys_steps=[-1, 2]", "0 <= first <= last"]),
    ("profile.timeline_steps=[3,5] train.steps=5", ["profile.timeline_steps=[3, 5]", "0..4", "raise train.steps"]),
    ("profile.nsys_steps=abc", ["profile.nsys_steps=abc"]),
    ("profile.nvtx=maybe", ["profile.nvtx=maybe"]),
    (
        "schedule=reference profile.timeline_steps=[1,2]",
        ["profile.timeline_steps=[1, 2]", "schedule=reference", "pipeline schedule"],
    ),
    ("foo.bar=1", ["unknown key 'foo'", "valid keys"]),
    # Hydra habits: its own settings are refused with what sysx uses instead; a sweep needs -m
    ("hydra.run.dir=/tmp/elsewhere", ["hydra.run.dir=/tmp/elsewhere", "Hydra's own settings", "run_dir=<dir>"]),
    ("hydra.job.chdir=true", ["hydra.job.chdir=true", "never changes the working directory"]),
    ("hydra.verbose=true", ["hydra.verbose=true", "log.every=1"]),
    ("hydra.foo=1", ["hydra.foo=1", "run_dir=<dir>", "-m (--multirun)"]),
    ("hydra/launcher=joblib", ["hydra/launcher=joblib", "Hydra's own settings"]),
    ("train.steps=1,2", ["train.steps", "needs -m (--multirun)"]),
    ("-m optim.lr=0.1,-1", ["sweep point 1 (", "optim.lr=-1", "> 0"]),
    ("-m model.init_from=a checkpoint.dir=/tmp/ck train.steps=1,2", ["checkpoint.dir=/tmp/ck", "shared", "remove it"]),
    ("train.steps", ["'train.steps'", "key=value"]),
    ("--bogus", ["'--bogus'", "key=value"]),
    ("--cfg bad", ["--cfg bad", "--cfg job"]),
    # metrics backends (a missing package: tests/test_tracking.py, which hides it)
    ("log.backends=[jsonl,tb]", ["log.backends=[jsonl,tb]", "tb is unknown", "allowed: jsonl, tensorboard, wandb"]),
    ("log.wandb_mode=cloud", ["log.wandb_mode=cloud", "allowed: auto, offline, online"]),
    ("log.backends=tensorboard", ["log.backends=tensorboard", "a list of strings, e.g. [tensorboard]"]),
]

CLI_CASES: list[tuple[str, list[str]]] = [
    ("plan --ranks 0", ["--ranks 0", ">= 1"]),
    ("plan --microbatches 0", ["--microbatches 0", ">= 1"]),
    ("plan --hydra model=nope", ["model=nope", "allowed"]),
    ("plan --hydra hydra.run.dir=x", ["hydra.run.dir=x", "Hydra's own settings", "run_dir=<dir>"]),
    ("nope", ["unknown command 'nope'", "commands:"]),
]


def _write_files(d: Path) -> None:
    """The token files the cases name (ids 0..240 unless said otherwise)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 241, size=20000).astype(np.uint16)
    ids[7] = 240
    for name in ("raw", "odd", "u32", "empty", "tiny"):
        (d / name).mkdir()
    ids.tofile(d / "raw" / "train.bin")
    ids[:2000].tofile(d / "raw" / "val.bin")
    (d / "odd" / "train.bin").write_bytes(ids.tobytes() + b"\0")
    ids.astype(np.uint32).tofile(d / "u32" / "train.bin")
    (d / "empty" / "train.bin").write_bytes(b"")
    ids[:101].tofile(d / "tiny" / "train.bin")  # 202 bytes: not a whole number of uint32 ids
    with SampleWriter(d / "samples" / "chat.bin", vocab_size=256, tokenizer={"kind": "byte"}) as w:
        for n in (12, 40, 9, 15):  # instruction samples; the longest (40 tokens) needs train.seq_len >= 39
            w.write_sample(ids[:n], [0] * (n // 2) + [1] * (n - n // 2))
        w.finish(val_fraction=0.25)
    for name in ("trunc", "badmeta", "corrupt"):
        with TokenWriter(d / name / "tokens.bin", vocab_size=256, tokenizer={"kind": "byte"}) as w:
            w.write(ids)
            w.finish(val_fraction=0.1)
    with open(d / "trunc" / "tokens.bin", "r+b") as f:
        f.truncate(len(ids) * 2 - 1)
    (d / "badmeta" / "tokens.meta.json").write_text("{not json")
    (ids.astype(np.uint32) * 1000).astype(np.uint16).tofile(d / "corrupt" / "tokens.bin")
    (d / "afile").write_text("not a directory\n")
    _write_hf_folders(d)


def _write_hf_folders(d: Path) -> None:
    """Hugging Face folders as a download can leave them (weights are read only for their headers here)."""
    import torch
    from safetensors.torch import save_file

    from sysx.model import get_preset
    from sysx.model.hf import config_to_hf

    config = json.dumps(config_to_hf(get_preset("tiny")))
    for name in ("hf_truncated", "hf_noconfig", "hf_tokenizer"):
        (d / name).mkdir()
        save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / name / "model.safetensors"))
        if name != "hf_noconfig":
            (d / name / "config.json").write_text(config)
    with open(d / "hf_truncated" / "model.safetensors", "r+b") as f:
        f.truncate(40)
    vocab = {f"w{i}": i for i in range(300)}
    (d / "hf_tokenizer" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad_inputs")
    _write_files(d)
    return d


def _segments() -> set[str]:
    """Segments this process made or a dead process left (another job on the machine may hold live ones)."""
    from sysx.memory.cleanup import scan

    return {info.name for info in scan() if info.creator_pid == os.getpid() or info.status != "alive"}


def _call(func: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = func(argv)
    return rc, err.getvalue()


def _assert_one_line(stderr: str, prefix: str, expect: list[str]) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith(prefix) and "Traceback" not in stderr, line
    for part in expect:
        if part.startswith("!"):
            assert part[1:] not in line, f"{part[1:]!r} should not be in: {line}"
        else:
            assert part in line, f"{part!r} not in: {line}"
    return line


def _argv(spec: str, d: Path, run_dir: Path) -> list[str]:
    argv = spec.format(d=d).split()
    if not any(a.startswith("run_dir=") for a in argv):
        argv.append(f"run_dir={run_dir}")
    return argv


@pytest.mark.parametrize("spec,expect", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(
    spec: str, expect: list[str], data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sysx.train import main

    monkeypatch.delenv("RANK", raising=False)
    before, files_before = _segments(), sorted(data_dir.rglob("*"))
    # an earlier in-process job's shared-memory guardian lives as long as this process: only new ones count
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    run_dir = tmp_path / "run"
    rc, stderr = _call(main, _argv(spec, data_dir, run_dir))
    assert rc == 2, stderr
    _assert_one_line(stderr, "sysx-train: error: ", expect)
    assert not run_dir.exists(), "run_dir was created for a job that never started"
    assert sorted(data_dir.rglob("*")) == files_before, "a file was left beside the inputs"
    assert _segments() <= before, "a shared-memory segment was left"
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    assert not left, f"a process was left: {left}"


@pytest.mark.parametrize(
    "env,expect",
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, ["WORLD_SIZE=2 RANK=0 without MASTER_ADDR", "launcher", "unset"]),
        (
            {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"},
            ["RANK=5 is outside the job", "ranks 0..1"],
        ),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK=x", "integer"]),
    ],
    ids=["no-master-addr", "rank-outside-world", "rank-not-integer"],
)
def test_launcher_environment_without_a_launcher(
    env: dict[str, str], expect: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launcher variables set by hand: one line at once (a traceback or a 20-minute wait before)."""
    from sysx.train import main

    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rc, stderr = _call(main, [f"run_dir={tmp_path / 'run'}", "schedule=sysx", "device=cpu"])
    assert rc == 2, stderr
    _assert_one_line(stderr, "sysx-train: error: ", expect)
    assert not (tmp_path / "run").exists()


def test_sweep_under_a_launcher_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.train import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29598"}.items():
        monkeypatch.setenv(key, value)
    rc, stderr = _call(main, ["-m", "train.steps=1,2", f"run_dir={tmp_path / 'run'}"])
    assert rc == 2, stderr
    _assert_one_line(stderr, "sysx-train: error: ", ["-m (a sweep)", "WORLD_SIZE=2", "one launcher job per point"])
    assert not (tmp_path / "run").exists()


def test_check_of_one_process_resolves_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sysx-train --check`` with the defaults (schedule=auto -> single, precision=auto): once a KeyError."""
    from sysx.train import main

    assert main(["--check", "device=cpu", f"run_dir={tmp_path / 'run'}"]) == 0
    assert "sysx-train --check: ok (1 process; single: W=" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_damaged_checkpoint_layer_is_one_line(tmp_path: Path) -> None:
    """A resumed run whose checkpoint has a corrupted layer file: one line naming the file, no traceback."""
    from sysx.train import main

    args = ["schedule=reference", "device=cpu", "model.n_layers=1", "train.seq_len=16", "train.micro_batch_size=2"]
    args += ["eval.every=0", "log.progress=false", f"run_dir={tmp_path / 'run'}"]
    assert _call(main, [*args, "train.steps=1"])[0] == 0
    layer = sorted((tmp_path / "run" / "checkpoints").glob("step-*/layer-*.safetensors"))[-1]
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    rc, stderr = _call(main, [*args, "train.steps=2"])
    assert rc == 2, stderr
    _assert_one_line(stderr, "sysx-train: error: ", [layer.name, "checksum differs", "damaged", "train.resume="])


def _rendezvous_rank1(port: int, timeout_s: float, tmp_path: Path) -> subprocess.Popen[str]:
    """Rank 1 of 2 whose rank 0 never comes: it reaches the store (held by the test) and waits there."""
    env = {**_env(), "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = ["schedule=sysx", "device=cpu", f"schedule.timeout_s={timeout_s}", f"run_dir={tmp_path / 'run'}"]
    return subprocess.Popen(
        [sys.executable, "-m", "sysx.train", *argv], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )


def _store() -> tuple[object, int]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    return store, store.port


def _wait_until_connected(proc: subprocess.Popen[str], port: int, limit_s: float = 240) -> None:
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        conns = psutil.Process(proc.pid).net_connections(kind="tcp")
        if any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in conns):
            return
        time.sleep(0.2)
    raise AssertionError("rank 1 never reached the store")


@pytest.mark.timeout(300)
def test_rendezvous_wait_is_bounded_by_timeout_s(tmp_path: Path) -> None:
    store, port = _store()
    proc = _rendezvous_rank1(port, 3, tmp_path)
    _, stderr = proc.communicate(timeout=280)
    assert proc.returncode == 2, stderr
    _assert_one_line(stderr, "sysx-train: error: ", ["rank 1: joining the job's 2 ranks", "within 3 s", "timeout_s"])
    del store


@pytest.mark.timeout(300)
def test_rendezvous_wait_ends_on_sigterm(tmp_path: Path) -> None:
    import signal
    import time

    store, port = _store()
    proc = _rendezvous_rank1(port, 600, tmp_path)
    _wait_until_connected(proc, port)
    time.sleep(1)  # inside init_process_group, waiting for rank 0
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - sent < 30, stderr
    assert "Traceback" not in stderr
    del store


def test_unwritable_cache_dir(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SYSX_CACHE_DIR where nothing can be written (under a file, so even root cannot)."""
    from sysx.train import main

    monkeypatch.setenv("SYSX_CACHE_DIR", str(data_dir / "afile" / "cache"))
    rc, stderr = _call(main, [f"run_dir={tmp_path / 'run'}"])
    assert rc == 2
    _assert_one_line(stderr, "sysx-train: error: ", ["SYSX_CACHE_DIR=", "afile", "set SYSX_CACHE_DIR"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec,expect", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(spec: str, expect: list[str]) -> None:
    from sysx.cli import main

    rc, stderr = _call(main, spec.split())
    assert rc == 2, stderr
    _assert_one_line(stderr, "sysx", expect)


def test_nanogpt_train_bin_without_val_gets_a_carved_val_split(data_dir: Path) -> None:
    from sysx.config import DataSection, EvalSection, SysxConfig, TrainSection
    from sysx.trainers.base import open_dataset

    cfg = SysxConfig(
        data=DataSection(name="file", path=str(data_dir / "u32" / "train.bin"), dtype="uint32", vocab_size=256),
        eval=EvalSection(every=10),
        train=TrainSection(seq_len=32),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ds = open_dataset(cfg)
    n_val = len(ds.split("val"))
    assert n_val == 8 * 33 and len(ds.split("train")) + n_val == 20000
    assert f"its last {n_val} tokens are the val split" in out.getvalue()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK")}
    env["PYTHONPATH"] = child_pythonpath(env)
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "spec,expect",
    [
        ("run_dir={d}/afile", ["run_dir=", "existing file"]),
        ("--check --ranks 2 schedule=sysx model=llama2_110b device=cpu", ["host memory the job needs", "Fix"]),
    ],
    ids=["run_dir-file", "preflight-host-memory"],
)
def test_subprocess_bad_input(spec: str, expect: list[str], data_dir: Path) -> None:
    before = _segments()
    proc = subprocess.run(
        [sys.executable, "-m", "sysx.train", *spec.format(d=data_dir).split()],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=data_dir,
    )
    assert proc.returncode == 2, proc.stderr
    _assert_one_line(proc.stderr, "sysx-train: error: ", expect)
    assert _segments() <= before


@pytest.mark.timeout(300)
def test_plan_ops_into_head_is_not_an_error() -> None:
    proc = subprocess.run(
        f"{sys.executable} -m sysx.cli plan --ops | head -1",
        shell=True,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.stdout.startswith("rank 0") and proc.stderr == "", proc.stderr


@pytest.mark.timeout(600)
def test_torchrun_prints_the_line_once(data_dir: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"torchrun is not installed beside {sys.executable}")
    before = _segments()
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "sysx.train",
            "schedule=sysx",
            "data=file",
            f"data.path={data_dir / 'raw' / 'train.bin'}",
            "data.dtype=uint16",
            "data.vocab_size=100",
            f"run_dir={run_dir}",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith(("sysx-train", "[rank"))]
    assert proc.returncode != 0
    assert ours == [
        "sysx-train: error: data.vocab_size=100 is too small for "
        f"{data_dir / 'raw' / 'train.bin'}: train ids reach 240; set data.vocab_size=241 or larger "
        "(the tokenizer's vocabulary size)"
    ], proc.stderr
    assert not run_dir.exists() and _segments() <= before


if __name__ == "__main__":  # the matrix as "input -> line", for the closing note
    import tempfile

    from sysx.train import main as train_main

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _write_files(d)
        for spec, _ in TRAIN_CASES:
            rc, stderr = _call(train_main, _argv(spec, d, d / "run"))
            print(json.dumps({"input": spec, "rc": rc, "line": stderr.strip()}))
