"""Checkpoints of a training job: resume at start, save every ``checkpoint.every`` steps and at
the end, export a Hugging Face folder.

Every trainer says which flat layers this rank owns and how to read and restore them
(:meth:`Trainer.checkpoint_layers`, :meth:`Trainer.restore_layers`); everything else — the step,
the loss scaler, the random generators, the configuration, the model-shape check — is common and
lives in :class:`Trainer` (:meth:`~Trainer.training_state`, :meth:`~Trainer.load_checkpoint`).
:class:`JobCheckpoints` drives a run: it is what ``sysx-train`` uses and what the tests use, so a
test of resume exercises the job's own path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sysx import peers
from sysx.checkpoint import Checkpoint, CheckpointSaver, SaveReport, find_resume
from sysx.checkpoint.flat_state import flat_layer_states, load_flat
from sysx.checkpoint.layer_state import LayerState
from sysx.checkpoint.saver import LayerSource
from sysx.model.flat import FlatLayout
from sysx.optim.stage import StageOptimizer

if TYPE_CHECKING:
    from sysx.metrics import RunLogger, StepResult
    from sysx.trainers.base import Trainer


def stage_layer_sources(
    stage: StageOptimizer, layout: FlatLayout, layer_indices: Sequence[int]
) -> dict[int, LayerSource]:
    """The layers held by one host optimizer (a pipeline sub-stage or a window group), as sources;
    with the NVMe tier each source reads the stage's state when the save takes it and copies out
    its layer (the staging buffer is the tier's)."""
    adam = stage.optimizer
    if adam.store is None:
        return flat_layer_states(
            layout, layer_indices, adam.param, adam.exp_avg, adam.exp_avg_sq, lambda: adam.step_count
        )
    sources: dict[int, LayerSource] = {}
    for index in dict.fromkeys(layer_indices):

        def source(index: int = index) -> LayerState:
            with stage.resident():
                views = flat_layer_states(
                    layout, layer_indices, adam.param, adam.exp_avg, adam.exp_avg_sq, lambda: adam.step_count
                )
                return views[index]().snapshot()

        sources[index] = source
    return sources


def restore_stage(
    stage: StageOptimizer,
    layout: FlatLayout,
    layer_indices: Sequence[int],
    layers: Mapping[int, LayerState],
    *,
    what: str,
    shard: range | None = None,
) -> None:
    """Fill one host optimizer's masters, moments and step count from checkpointed layers, then
    rewrite its working copy (the 16-bit copy the device loads). ``shard``: the optimizer holds
    these elements of the layers' flat buffer (a replica's shard, :mod:`sysx.replicas`)."""
    adam = stage.optimizer
    steps = {layers[i].step for i in set(layer_indices)}
    if len(steps) != 1:
        raise ValueError(
            f"{what}: layers {sorted(set(layer_indices))} were saved at different Adam step counts {steps}"
        )
    with stage.resident():  # the NVMe tier writes the restored state to the stage's file on leaving
        for field, out in (("weight", adam.param), ("exp_avg", adam.exp_avg), ("exp_avg_sq", adam.exp_avg_sq)):
            tensors = {i: getattr(s, field) for i, s in layers.items()}
            if shard is None:
                load_flat(layout, layer_indices, tensors, out, what=what)
                continue
            full = torch.empty(layout.numel, dtype=out.dtype)
            load_flat(layout, layer_indices, tensors, full, what=what)
            out.copy_(full[shard.start : shard.stop])
        adam.resume_at(steps.pop())
        stage.write_target()


class JobCheckpoints:
    """Resume, periodic and final saves, and the export of one run (every rank has one)."""

    def __init__(self, trainer: Trainer, *, tag: str | None = None) -> None:
        cfg = trainer.cfg
        self.trainer = trainer
        self.dir = Path(cfg.checkpoint_dir)
        self.every = cfg.checkpoint.every
        tag = tag or trainer.job_tag
        watch = peers.current()
        if watch is not None:  # a restarted job keeps its job id: its saves must not write into the failed one's
            tag = f"{tag}-{watch.attempt_id()}"
        self.saver = CheckpointSaver(
            self.dir,
            rank=trainer.rank,
            world=trainer.world,
            keep=cfg.checkpoint.keep,
            tag=tag,
            peer_check=_peers_alive,
        )
        self.reports: list[SaveReport] = []
        self.saved_step: int | None = None
        self.resumed_from: Checkpoint | None = None

    def resume(self) -> Checkpoint | None:
        """Load the checkpoint ``train.resume`` names (``auto``: the latest in ``checkpoint.dir``)."""
        ckpt = find_resume(self.trainer.cfg.train.resume, self.dir)
        if ckpt is not None:
            self.trainer.load_checkpoint(ckpt)
            self.saved_step = ckpt.step
            self.resumed_from = ckpt
        return ckpt

    def save(self, *, background: bool = True) -> SaveReport:
        """Save the state after the last finished step; returns what it cost the training loop."""
        t = self.trainer
        watch = peers.current()
        if watch is not None:  # named if this rank dies during the save; where `SYSX_FAULT=kill@R:save N` fires
            watch.doing(f"save {t.step_index}")
        t0 = time.perf_counter()
        t.finish_pending()  # the steps still running on optimizer threads belong to this state
        waited = time.perf_counter() - t0
        manifest = {"model": asdict(t.model_cfg), "saved_by": {"schedule": t.cfg.schedule.name, "world": t.world}}
        report = self.saver.save(
            t.step_index,
            t.checkpoint_layers(),
            manifest=manifest,
            trainer_state=t.training_state() if t.rank == 0 else None,
            background=background,
        )
        report = SaveReport(report.step, report.mode, report.stall_s + waited, report.nbytes)
        self.reports.append(report)
        self.saved_step = t.step_index
        return report

    def after_step(self, result: StepResult) -> None:
        """Save when ``checkpoint.every`` says so; the stall is recorded on ``result``."""
        done = result.step + 1
        if self.every > 0 and done % self.every == 0 and done < self.trainer.cfg.train.steps:
            result.checkpoint_stall_s = self.save().stall_s

    def finish(self, logger: RunLogger | None = None) -> Path | None:
        """The end of training: save unless this step is saved already, wait for the writes,
        export the Hugging Face folder if asked. Returns the final checkpoint's path (rank 0)."""
        t0 = time.perf_counter()
        if self.saved_step != self.trainer.step_index:
            self.save(background=False)
        path = self.saver.wait() or (self.resumed_from.path if self.resumed_from is not None else None)
        seconds = time.perf_counter() - t0
        cfg = self.trainer.cfg
        exported = None
        if cfg.checkpoint.export_hf and self.trainer.rank == 0 and path is not None:
            exported = export_hf(
                path, Path(cfg.run_dir) / "hf", tokenizer_dir=self.trainer.tokenizer_dir(), source=cfg.model.init_from
            )
        if logger is not None:
            stalls = [r.stall_s for r in self.reports]
            logger.note(
                "checkpoint",
                {
                    "dir": str(self.dir),
                    "last": str(path) if path else None,
                    "saves": len(stalls),
                    "stall_s_total": sum(stalls),
                    "stall_s_max": max(stalls, default=0.0),
                    "final_s": seconds,
                    "bytes_per_rank": self.reports[-1].nbytes if self.reports else 0,
                    "hf_export": str(exported) if exported else None,
                },
            )
            logger.info(
                f"checkpoint: {path} ({len(stalls)} save(s), training stalled {sum(stalls):.2f} s in all; "
                f"final save {seconds:.2f} s)" + (f" | Hugging Face folder {exported}" if exported else "")
            )
        return path

    def close(self, *, failing: bool = False) -> None:
        """Finish a save in flight and stop the writer thread (``failing``: see :meth:`CheckpointSaver.close`)."""
        self.saver.close(failing=failing)


def _peers_alive() -> None:
    """Raise when another rank of the job died or failed: rank 0's commit waits for every rank's
    layers, and those of a rank that is gone never come (it would wait ``commit_timeout_s``)."""
    watch = peers.current()
    if watch is not None:
        watch.raise_failure("checkpoint commit")


def export_hf(checkpoint: Path, out: Path, *, tokenizer_dir: Path | None, source: str | None = None) -> Path:
    """Write a checkpoint's weights as a Hugging Face folder (with the tokenizer files, if any, and
    the special-token ids of ``source``, the model it started from, or of the tokenizer)."""
    from sysx.checkpoint.pretrained import build_model, open_pretrained
    from sysx.checkpoint.token_ids import export_token_ids
    from sysx.model.hf import export_hf_llama

    model = build_model(open_pretrained(checkpoint), dtype=torch.float32)
    token_ids = export_token_ids(source, tokenizer_dir)
    return export_hf_llama(model, out, tokenizer_dir=tokenizer_dir, token_ids=token_ids)
