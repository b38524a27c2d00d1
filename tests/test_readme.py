"""The README's commands run as a user types them (issue 24): every ```bash block is run as written,
in a fresh folder, with the venv active (the README says later commands assume it), on this
machine's CPU. A block that cannot run here is listed in SKIPPED with the reason, never dropped
silently; the inputs a block names as the user's own (``my_texts/``) are made here, tiny.
``sysx-train`` and ``sysx`` lines run in this process (their ``main``, as the console scripts call it); launchers, scripts and ``python`` lines run as their own processes. The ``python`` block of
the fine-tune section runs too. Launch scripts find the project's interpreter without an active venv.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent

# The blocks not run, by their first line, with why. Each is covered elsewhere or needs what CI lacks.
SKIPPED = {
    "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e . && .venv/bin/sysx-train": (
        "installs the package (network) before its main job of 500 steps (~2 min); the job is "
        "test_train.py::test_default_job_end_to_end cut to 60 steps, and profiling/bench_default_job.py"
    ),
    'python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e ".[test]"': (
        "installs the package and runs this test suite (`.ci/run` runs it verbatim)"
    ),
    "python profiling/bench_pipeline.py --steps 4 --time-scale 0.5 --retries 3 --json bench.jsonl": (
        "the full benchmark (~2 h); tests/test_bench_pipeline.py checks its cells"
    ),
    "python -m sysx.launch --standalone --nproc_per_node=4 --max-restarts=2 -m sysx.train \\": (
        "three 4-rank jobs of 500 steps (the recipe for long runs); tests/test_elastic_restart.py runs "
        "restarts through the wrapper (2 ranks) and TORCHRUN_ARGS through two_nodes_localhost.sh (4 ranks)"
    ),
    "SYSX_FAULT='kill@1:step 4#0,kill@3:save 9#1' python -m sysx.launch --standalone --nproc_per_node=4 \\": (
        "4 ranks restarted twice (about a minute); tests/test_elastic_restart.py runs this fault schedule "
        "on 4 ranks and compares the losses with an uninterrupted run's"
    ),
}
# Lines skipped inside a block that otherwise runs: (the line's start, why).
SKIPPED_LINES = {
    "python -m sysx.launch --standalone --nproc_per_node=4 -m sysx.train device=emulated": "4 ranks pacing "
    "modelled time (about 2 min on 2 busy cores); tests/test_emulate.py runs this job at emulate.time_scale=0.02",
    "python profiling/bench_pipeline.py --quick": "three 4-rank emulated runs of a 10B model (minutes); "
    "tests/test_bench_pipeline.py runs the benchmark on a small cell",
    "sysx-train model=llama2_7b data=file data.path=/data/owt/train.bin": "needs your own token file "
    "(/data/owt/train.bin) and ~110 GiB of host memory for the 7B model's states",
    "sbatch launch/slurm.sbatch": "needs a Slurm cluster with GPUs",
    "NP=2 launch/mpirun.sh schedule=sysx": "a 2-rank job's start costs ~30 s here, and "
    "tests/test_runtime_procs.py::test_two_torchrun_nodes_on_localhost_and_mpirun runs this launcher through a "
    "whole job (test_stop.py and test_launch_failures.py its stops and failures)",
    "NPROC=2 launch/torchrun.sh schedule=sysx": "the 2-rank job of the line above after a pre-flight "
    "(the suite's time budget); tests/test_stop.py runs launch/torchrun.sh, pre-flight included, through whole "
    "jobs and their stops, and test_launch_failures.py through its failures",
    "NPROC=1 launch/two_nodes_localhost.sh schedule=sysx": "a 2-rank job's start costs ~30 s here, and "
    "tests/test_runtime_procs.py::test_two_torchrun_nodes_on_localhost_and_mpirun runs this launcher through a "
    "whole job (test_stop.py and test_launch_failures.py its stops and failures)",
    'TORCHRUN_ARGS="--max-restarts=3" sbatch launch/slurm.sbatch': "needs a Slurm cluster with GPUs",
    "NNODES=2 NODE_RANK=0 MASTER=node0:29533": "needs two machines with 4 GPUs each (node0 and node1)",
    "NNODES=2 NODE_RANK=1 MASTER=node0:29533": "needs two machines with 4 GPUs each (node0 and node1)",
    "sbatch --nodes=2 --gpus-per-node=4 launch/slurm.sbatch": "needs a Slurm cluster with GPUs",
    "tensorboard --logdir runs/chat/tensorboard": "a server (it serves until Ctrl-C); "
    "tests/test_tracking.py reads the event files back with TensorBoard's own reader",
    "NPROC=4 launch/torchrun.sh parallel.replicas=2": "a 4-rank job (about a minute on 2 busy cores); "
    "tests/test_runtime_procs.py::test_two_torchrun_nodes_on_localhost_and_mpirun runs 2 replicas x 2 ranks "
    "through mpirun.sh on one node, tests/test_replicas_procs.py the same layout against the reference",
    "NPROC=2 launch/two_nodes_localhost.sh parallel.replicas=2": "a 4-rank job (about a minute on 2 busy cores); "
    "tests/test_replicas_procs.py runs 2 replicas x 2 ranks on two localhost nodes against the reference",
}

# Lines run shorter than written: (the line's start) -> (what the README says, what runs, why).
SHORTENED = {
    "sysx-train model.init_from=models/tiny-chat": (
        "train.steps=150",
        "train.steps=40",
        "the 150 steps show what the model learns (the README prints their output); 40 run every part the later "
        "lines use (the checkpoint, the Hugging Face export, TensorBoard) in a quarter of the suite's time",
    ),
    "sysx-train train.steps=20 train.micro_batch_size=4": (
        "train.steps=20",
        "train.steps=4",
        "the line shows Hydra overrides; 4 steps take every one of them (test_train.py runs jobs to the end)",
    ),
    "python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=sysx": (
        "train.steps=20",
        "train.steps=4",
        "the launch is what the line shows; tests/test_runtime_procs.py runs 2-rank jobs against the reference",
    ),
    "sysx-train -m optim.lr=1e-3,3e-4": (
        "train.steps=2,4",
        "train.steps=2",
        "each point is a job of its own (~6 s here, half of it the start); 2 points show the sweep's run dirs and "
        "summary, and tests/test_sweep_and_help.py runs a 2 x 2 grid with a failing point",
    ),
    "sysx-train train.steps=20 optim.offload=nvme": (
        "train.steps=20",
        "train.steps=4",
        "the tier's state files are made, used and removed in 4 steps; tests/test_nvme_tier.py runs 50 against "
        "host memory",
    ),
}


@dataclass
class Block:
    """One fenced block of the README."""

    line: int  # 1-based line of its opening fence
    lang: str
    text: str

    @property
    def first(self) -> str:
        return self.text.splitlines()[0].split("  #")[0].strip() if self.text.strip() else ""


def blocks(lang: str) -> list[Block]:
    """The README's fenced blocks of ``lang``."""
    found, lines = [], README.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        if fence.group(1) == lang:
            found.append(Block(i + 1, lang, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return found


def _uncommented(line: str) -> str:
    """``line`` without its shell comment (a ``#`` starting a word, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comment lines and comments dropped."""
    joined = block.text.replace("\\\n", " ")
    return [line.strip() for line in map(_uncommented, joined.splitlines()) if line.strip()]


def skipped_line(command: str) -> bool:
    return any(command.startswith(start) for start in SKIPPED_LINES)


def _in_process(main: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # --help ends through argparse / Hydra
        return int(exit_.code or 0)


def run_command(command: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run one README line as written in ``cwd``; returns its exit status and (for processes) output."""
    words = shlex.split(command)
    assignments = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        assignments[key] = value
    if not assignments and words[0] in ("sysx-train", "sysx"):
        from sysx.cli import main as sysx_main
        from sysx.train import main as train_main

        here = os.getcwd()
        os.chdir(cwd)
        try:
            return _in_process(train_main if words[0] == "sysx-train" else sysx_main, words[1:]), ""
        finally:
            os.chdir(here)
    proc = subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, executable="/bin/bash"
    )
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:]


def user_files(cwd: Path) -> None:
    """What the Tools section asks the user to bring: text (the fine-tune section makes its own stand-ins)."""
    (cwd / "my_texts").mkdir()
    for i in range(3):
        (cwd / "my_texts" / f"{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 60}" for j in range(10_000)))


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    firsts = [b.first for b in blocks("bash")]
    for first in SKIPPED:
        assert any(f.startswith(first) for f in firsts), f"SKIPPED names a block the README no longer has: {first}"
    every_line = [c for b in blocks("bash") for c in commands(b)]
    for start in SKIPPED_LINES:
        assert any(c.startswith(start) for c in every_line), f"SKIPPED_LINES names a line not in the README: {start}"
    for start, (written, _, _) in SHORTENED.items():
        assert any(c.startswith(start) and written in c.split() for c in every_line), (
            f"SHORTENED names a line or value not in the README: {start} ... {written}"
        )


def shortened(command: str) -> str:
    """``command`` as the test runs it (:data:`SHORTENED`)."""
    for start, (written, runs, _) in SHORTENED.items():
        if command.startswith(start):
            return " ".join(runs if word == written else word for word in command.split(" "))
    return command


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_commands_run_as_written(tmp_path: Path) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for tree in ("launch", "profiling", "examples"):  # the README runs them from the checkout's root
        (cwd / tree).symlink_to(ROOT / tree)
    user_files(cwd)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")}
    env.update(  # the venv is active, as the README's quick start says
        VIRTUAL_ENV=str(VENV_BIN.parent), PATH=f"{VENV_BIN}:{env.get('PATH', '')}", OMP_NUM_THREADS="1"
    )
    timings = []
    for block in blocks("bash"):
        if any(block.first.startswith(first) for first in SKIPPED):
            continue
        for command in commands(block):
            if skipped_line(command):
                continue
            t0 = time.perf_counter()
            status, output = run_command(shortened(command), cwd, env)
            timings.append(f"{time.perf_counter() - t0:6.1f} s  {command[:100]}")
            print(f"README test: {timings[-1]}", file=sys.stderr, flush=True)
            assert status == 0, f"README line {block.line}: `{command}` exited {status}\n{output}"
    for block in blocks("python"):  # the fine-tune's export in transformers, in its own process as a user runs it
        proc = subprocess.run(
            [sys.executable, "-c", block.text], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"README line {block.line}: python block failed\n{proc.stderr[-4000:]}"
        assert proc.stdout.strip(), "the generation printed nothing"
    print("\n".join(timings))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_scripts_find_the_projects_interpreter_without_an_active_venv(tmp_path: Path) -> None:
    """``NPROC=1 launch/torchrun.sh`` with neither an active venv nor its ``bin`` on PATH:
    the scripts take the checkout's ``.venv`` (here: the interpreter running this test, placed there
    by a symlink when the checkout has none), and say in one line when no interpreter has sysx."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(VENV_BIN.parent)
    (checkout / "launch").mkdir()
    for script in (ROOT / "launch").iterdir():
        (checkout / "launch" / script.name).symlink_to(script)
    # the scripts' folder decides: a symlinked script still finds the checkout it is in
    found = subprocess.run(
        ["bash", "-c", f"source {checkout / 'launch' / '_python.sh'} && echo $PYTHON"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0 and found.stdout.strip() == str(checkout / ".venv" / "bin" / "python"), found
    checked = subprocess.run(  # the pre-flight runs (and refuses the value in one line): sysx was found
        ["bash", str(checkout / "launch" / "torchrun.sh"), "precision=fp8"],
        env={**env, "NPROC": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert checked.returncode == 2, checked.stderr[-3000:]
    assert checked.stderr.strip().splitlines()[-1].startswith("sysx-train: error: precision=fp8 is not valid")
    lacking = subprocess.run(
        ["bash", str(ROOT / "launch" / "torchrun.sh"), "train.steps=1"],
        env={**env, "NPROC": "1", "PYTHON": "/bin/false"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lacking.returncode == 2 and lacking.stdout == ""
    assert lacking.stderr.strip().splitlines() == [
        "torchrun.sh: /bin/false cannot import sysx and its dependencies; activate the project's venv "
        "(source .venv/bin/activate), or set PYTHON=/path/to/the/venv/bin/python"
    ]
