"""The whole job configuration (:class:`SysxConfig`) and :func:`validate`, which checks it once."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sysx.config.checks import check_choice, check_int, fail
from sysx.config.choices import EMULATED_DEVICE, PRECISION_CHOICES, bind_setting
from sysx.config.schedule_keys import refuse_ignored_keys
from sysx.config.sections import (
    CheckpointSection,
    DataSection,
    EmulateSection,
    EvalSection,
    LogSection,
    LossScaleSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    ProfileSection,
    ScheduleSection,
    SingleSection,
    TrainSection,
)

if TYPE_CHECKING:
    from sysx.model import ModelConfig


@dataclass
class SysxConfig:
    """The whole job configuration (``conf/config.yaml`` composed on this schema)."""

    model: ModelSection = field(default_factory=ModelSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    single: SingleSection = field(default_factory=SingleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    emulate: EmulateSection = field(default_factory=EmulateSection)
    seed: int = 0  # model init and data sampling
    device: str = "auto"  # auto (cuda if present, else cpu) | cpu | cuda | cuda:<index> | emulated
    # auto (bf16 on a GPU, fp32 on CPU; resolved by the trainer for its device) | fp32 | bf16 | fp16
    precision: str = "auto"
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"  # where rank 0 writes config.yaml, metrics.jsonl, summary.json

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else f"{self.run_dir}/checkpoints"

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step (all micro-batches of every replica)."""
        return self.parallel.count * self.train.micro_batches * self.train.micro_batch_size * self.train.seq_len


def validate(cfg: SysxConfig) -> None:
    """Check what types alone cannot: the top-level keys, then each section (its own
    ``validate()``), then what spans sections. Raise :class:`ConfigError` on the first problem."""
    check_choice("precision", cfg.precision, PRECISION_CHOICES)
    if not re.fullmatch(rf"auto|cpu|cuda(:\d+)?|{EMULATED_DEVICE}", cfg.device):
        fail("device", cfg.device, f"allowed: auto, cpu, cuda, cuda:<index>, {EMULATED_DEVICE}")
    check_int("seed", cfg.seed, 0)
    if not str(cfg.run_dir).strip():
        fail("run_dir", repr(cfg.run_dir), "give a directory path")
    for section in (
        cfg.train,
        cfg.parallel,
        cfg.optim,
        cfg.loss_scale,
        cfg.log,
        cfg.eval,
        cfg.single,
        cfg.data,
        cfg.schedule,
        cfg.checkpoint,
        cfg.profile,
        cfg.emulate,
    ):
        section.validate()
    check_profile_window(cfg)
    check_emulation(cfg)
    if cfg.parallel.count > 1 and cfg.schedule.name in ("reference", "single"):
        fail(
            "parallel.replicas",
            cfg.parallel.replicas,
            f"schedule={cfg.schedule.name} runs in one process; replicas need a pipeline schedule "
            "(sysx, gpipe, 1f1b, interleaved_1f1b, mobius) or parallel.replicas=1",
        )
    if bind_setting(cfg.parallel.bind_cores) is True and cfg.schedule.name in ("reference", "single"):
        fail(
            "parallel.bind_cores",
            True,
            f"schedule={cfg.schedule.name} runs in one process on every core, with no ranks to pin; remove the key",
        )
    if cfg.schedule.name != "auto":  # auto is checked once resolved (sysx.train.train_auto)
        refuse_ignored_keys(cfg.schedule.name, cfg.schedule, cfg.single)
    check_spread(cfg)
    chunk = cfg.single.seq_chunk
    if chunk and cfg.train.seq_len % chunk:
        fail("single.seq_chunk", chunk, f"must divide train.seq_len={cfg.train.seq_len} (or 0 = automatic)")
    if cfg.model.init_from is None:  # else the job checks it once it has read the weights' shape
        check_seq_len(cfg, model_config(cfg))


def check_seq_len(cfg: SysxConfig, model: ModelConfig) -> None:
    """``train.seq_len`` fits the model's ``max_seq_len``."""
    if cfg.train.seq_len > model.max_seq_len:
        fail(
            "train.seq_len",
            cfg.train.seq_len,
            f"must be <= model.max_seq_len={model.max_seq_len} (or raise model.max_seq_len)",
        )


def check_spread(cfg: SysxConfig) -> None:
    """``schedule.spread_last_step=true`` shards one unit's optimizer over the node's ranks: not with
    the replicas' shards of it, nor with state files per rank (the NVMe tier); null turns it off there."""
    if cfg.schedule.spread_last_step is not True:
        return
    if cfg.parallel.count > 1:
        fail(
            "schedule.spread_last_step",
            True,
            f"with parallel.replicas={cfg.parallel.replicas} the replicas already shard every sub-stage's "
            "optimizer; use one or the other",
        )
    if cfg.optim.offload != "host":
        fail(
            "schedule.spread_last_step",
            True,
            f"optim.offload={cfg.optim.offload} keeps each rank's optimizer state in its own files; "
            "use optim.offload=host or remove the key",
        )


def check_profile_window(cfg: SysxConfig) -> None:
    """A profile window lies within the run, and a timeline needs a schedule that records one."""
    for key in ("timeline_steps", "nsys_steps"):
        window = getattr(cfg.profile, key)
        if window is not None and window[1] >= cfg.train.steps:
            fail(
                f"profile.{key}",
                list(window),
                f"the run's steps are 0..{cfg.train.steps - 1} (train.steps="
                f"{cfg.train.steps}); end the window before that or raise train.steps",
            )
    if cfg.profile.timeline_steps is not None and cfg.schedule.name == "reference":
        fail(
            "profile.timeline_steps",
            list(cfg.profile.timeline_steps),
            "schedule=reference records no timeline; remove it or use a pipeline schedule or schedule=single",
        )


def check_emulation(cfg: SysxConfig) -> None:
    """``emulate.*`` is read with ``device=emulated`` only, which runs the pipeline schedules with a
    job model of the emulated preset's layer count."""
    if cfg.device != EMULATED_DEVICE:
        default = EmulateSection()
        for f in dataclasses.fields(EmulateSection):
            if getattr(cfg.emulate, f.name) != getattr(default, f.name):
                fail(
                    f"emulate.{f.name}",
                    getattr(cfg.emulate, f.name),
                    f"it is read with device={EMULATED_DEVICE} only; remove it or add device={EMULATED_DEVICE}",
                )
        return
    if cfg.schedule.name in ("single", "reference"):
        fail(
            "device",
            EMULATED_DEVICE,
            f"it emulates a multi-GPU pipeline, not schedule={cfg.schedule.name}; use "
            f"schedule=sysx (or gpipe, 1f1b, interleaved_1f1b, mobius)",
        )
    layers = cfg.emulate.preset_layers()
    if cfg.model.n_layers is not None and cfg.model.n_layers != layers:
        fail(
            "model.n_layers",
            cfg.model.n_layers,
            f"device={EMULATED_DEVICE} runs the job model with the {layers} layers "
            f"of emulate.model={cfg.emulate.model}; remove model.n_layers (it is set to {layers}) or set {layers}",
        )


def model_config(cfg: SysxConfig, pretrained: ModelConfig | None = None) -> ModelConfig:
    """The :class:`sysx.model.ModelConfig` of ``cfg.model``: the preset with the fields that are set.
    With ``device=emulated`` an unset ``model.n_layers`` is the emulated preset's layer count. With
    ``model.init_from``, ``pretrained`` is the weights' shape: config reads no files, so the job
    calls :func:`sysx.checkpoint.pretrained.job_model_config`, which reads it and comes here."""
    section = cfg.model
    if cfg.device == EMULATED_DEVICE and section.n_layers is None and section.init_from is None:
        section = dataclasses.replace(section, n_layers=cfg.emulate.preset_layers())
    return section.resolve(pretrained)
