"""The run directory: checked before a job allocates (:func:`check_run_dir`), created by rank 0
with the resolved ``config.yaml`` (:func:`prepare_run_dir`), and the configuration summary a job
prints at start (:func:`describe_run`). Job layer: engines never import it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sysx.config import ConfigError, SysxConfig, to_yaml
from sysx.config.choices import EMULATED_DEVICE
from sysx.metrics import fmt_count

if TYPE_CHECKING:
    import torch

    from sysx.model import ModelConfig

CONFIG_FILE = "config.yaml"


def check_run_dir(run_dir: str | Path) -> None:
    """Raise :class:`ConfigError` unless ``run_dir`` is, or can be made, a writable directory. Leaves
    nothing behind: the job checks this before it allocates, and rank 0 creates the directory later."""
    path = Path(run_dir).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the deepest part that exists decides
    if probe == path and not path.is_dir():
        raise ConfigError(f"run_dir={run_dir} is an existing file, not a directory; set run_dir to a directory path")
    if not probe.is_dir():
        raise ConfigError(
            f"run_dir={run_dir} is under {probe}, which is a file; set run_dir to a path under a directory"
        )
    try:  # a real write decides (os.access says yes to root on read-only or virtual file systems)
        os.rmdir(tempfile.mkdtemp(prefix=".sysx-probe-", dir=probe))
    except OSError as exc:
        raise ConfigError(
            f"run_dir={run_dir} cannot be written: {probe} is not writable ({exc.strerror or exc}); "
            "set run_dir to a writable directory"
        ) from None


def prepare_run_dir(cfg: SysxConfig, model: ModelConfig, *, is_main: bool) -> Path:
    """Rank 0 creates ``cfg.run_dir`` and writes the resolved ``config.yaml``; other ranks only get the path.

    ``model`` is the job's model shape (written in the header). ``cfg`` must be resolved (``run_dir`` without ``${now:...}``); with several processes, every rank
    must use rank 0's ``run_dir``. An existing directory is reused and its metrics file replaced.
    """
    run_dir = Path(cfg.run_dir)
    if is_main:
        check_run_dir(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            header = f"# resolved sysx-train configuration; model {cfg.model.preset} = {model.to_json()}\n"
            (run_dir / CONFIG_FILE).write_text(header + to_yaml(cfg))
        except OSError as exc:
            raise ConfigError(
                f"run_dir={cfg.run_dir} cannot be written: {exc.strerror or exc}; set run_dir to a writable directory"
            ) from None
    return run_dir


def describe_run(cfg: SysxConfig, *, n_params: int, device: torch.device, extra: str = "") -> str:
    """The configuration summary printed at start (model, batch, device, precision, run_dir)."""
    t, o = cfg.train, cfg.optim
    replicas = f"{cfg.parallel.count} replicas x " if cfg.parallel.count > 1 else ""
    lines = [
        f"sysx-train: schedule={cfg.schedule.name} model={cfg.model.init_from or cfg.model.preset} ({fmt_count(n_params)} parameters) "
        f"device={cfg.device if cfg.device == EMULATED_DEVICE else device} precision={cfg.precision} seed={cfg.seed}",
        f"  tokens/step {cfg.tokens_per_step} = {replicas}{t.micro_batches} micro-batches x {t.micro_batch_size} seqs x "
        f"{t.seq_len} tokens | steps {t.steps} | {o.name} lr {o.lr:g} (warmup {o.warmup_steps}, min {o.final_lr:g}) "
        f"wd {o.weight_decay:g} ({'norms too' if o.decay_norms else 'not on norms'}) clip {o.grad_clip:g}",
        f"  run_dir {cfg.run_dir}",
    ]
    if extra:
        lines.insert(2, f"  {extra}")
    return "\n".join(lines)
