"""The ``sysx`` command: tools around training (the main job is ``sysx-train``).

Each subcommand lives in the module that does its work and exposes ``main(argv) -> int``;
this file only maps names to those modules, so ``sysx --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module exposing main(argv) -> int, one-line help)
    "bench": (
        "sysx.optim.bench",
        "optimizer benchmark: `sysx bench optim --size 50M [--json]` (rollback modes), or backends, undo, async vs sync",
    ),
    "plan": (
        "sysx.plan_command",
        "build, validate and simulate a pipeline schedule; print the plan, draw the timeline",
    ),
    "plan-single": (
        "sysx.single.plan_cmd",
        "the single-GPU sliding-window plan of a model (rounds, window, memory), no training",
    ),
    "tune": (
        "sysx.autotune.cli",
        "profile this machine, simulate every pipeline configuration, print the best that fit",
    ),
    "shm": ("sysx.memory.cli", "list / clean this user's sysx shared-memory segments (stale = creator dead)"),
    "nvme": ("sysx.optim.nvme.cli", "list / clean this user's NVMe optimizer-state directories in an optim.nvme_dir"),
    "convert": ("sysx.checkpoint.convert", "convert model weights: sysx file <-> Hugging Face Llama directory"),
    "generate": (
        "sysx.generate.cli",
        "sample from a checkpoint, run directory or Hugging Face folder: greedy/top-p, chat template, streamed",
    ),
    "data": (
        "sysx.data.prepare",
        "token files: prepare from text or instruction rows (loss mask), info, build the default corpus",
    ),
    "train": ("sysx.train", "the training job, same as `sysx-train` (key=value overrides, --help)"),
}


def _usage() -> str:
    width = max((len(name) for name in COMMANDS), default=4)
    lines = ["usage: sysx <command> [args]   (the training job is `sysx-train`)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``sysx <command> ...`` to the command's module."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sysx: unknown command {name!r}; commands: {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # `sysx plan --ops | head`: the reader left; that is not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not raise again
        return 0


if __name__ == "__main__":
    sys.exit(main())
