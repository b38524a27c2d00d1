"""The sections of the job configuration, each a typed dataclass that checks its own fields.

``validate()`` on a section raises :class:`~sysx.config.checks.ConfigError` naming the first bad
key of that section; :func:`sysx.config.validate` calls them in turn and adds the checks that span
sections. The allowed values come from :mod:`sysx.config.choices`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sysx.config.checks import (
    ConfigError,
    check_choice,
    check_installed,
    check_int,
    check_positive,
    fail,
    first_line,
)
from sysx.config.choices import (
    ASSUMED_CPUS,
    ASSUMED_DISKS,
    ASSUMED_HARDWARE,
    ASSUMED_NETWORKS,
    BIND_CORES,
    DATA_SOURCES,
    HARDWARE,
    LOG_BACKENDS,
    OPTIM_BACKENDS,
    OPTIMIZERS,
    OVERLAPS,
    PLACEMENTS,
    POLICIES,
    ROLLBACKS,
    SAVE_LEVELS,
    SPECULATE_AFTER,
    SPECULATE_MODES,
    SYSX_CFGS,
    TOKEN_DTYPES,
    WANDB_MODES,
)
from sysx.config.offload import check_offload

if TYPE_CHECKING:
    from sysx.model import ModelConfig

MODEL_OVERRIDE_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "norm_eps",
    "rope_theta",
    "max_seq_len",
    "tie_embeddings",
    "rope_type",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)
_MODEL_COUNTS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


@dataclass
class ModelSection:
    """``model=<preset>``: a preset of :data:`sysx.model.PRESETS`; a field left ``None`` keeps the
    preset's value, a field that is set replaces it."""

    preset: str = "tiny"  # a preset of sysx.model.PRESETS (model=<preset> picks it)
    vocab_size: int | None = None  # token ids (null: the preset's)
    dim: int | None = None  # model width
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # attention heads (divides dim)
    n_kv_heads: int | None = None  # key/value heads, grouped-query attention (divides n_heads)
    ffn_dim: int | None = None  # hidden width of the SwiGLU feed-forward
    norm_eps: float | None = None  # RMSNorm epsilon
    rope_theta: float | None = None  # RoPE base
    max_seq_len: int | None = None  # longest sequence (train.seq_len must fit)
    tie_embeddings: bool | None = None  # the head shares the embedding's weight
    rope_type: str | None = None  # default | llama3 (Llama-3.1 scaling: the four rope_* fields below)
    rope_factor: float | None = None  # llama3 RoPE scaling factor
    rope_low_freq_factor: float | None = None  # llama3 RoPE low-frequency factor
    rope_high_freq_factor: float | None = None  # llama3 RoPE high-frequency factor
    rope_original_max_len: int | None = None  # llama3 RoPE: the pre-scaling context length
    init_from: str | None = None  # pretrained weights: an HF Llama folder, a sysx model file or checkpoint

    def resolve(self, pretrained: ModelConfig | None = None) -> ModelConfig:
        """The :class:`sysx.model.ModelConfig`: the preset with the fields that are set, checked; with
        ``init_from``, ``pretrained`` is the shape of those weights (read by the job through
        :func:`sysx.checkpoint.pretrained.job_model_config`) and a field set to another value is refused."""
        from sysx.model import PRESETS, get_preset  # torch: only when a model is built, not for --help

        if self.init_from is not None:
            if pretrained is None:
                raise ValueError(
                    f"model.init_from={self.init_from}: the shape comes from the weights; "
                    "resolve it with sysx.checkpoint.pretrained.job_model_config"
                )
            return self._pretrained_shape(pretrained)
        check_choice("model.preset", self.preset, sorted(PRESETS))
        changes = {name: getattr(self, name) for name in MODEL_OVERRIDE_FIELDS if getattr(self, name) is not None}
        for name in _MODEL_COUNTS:
            if name in changes:
                check_int(f"model.{name}", changes[name], 1)
        merged = {**dataclasses.asdict(get_preset(self.preset)), **changes}
        dim, n_heads, n_kv_heads = merged["dim"], merged["n_heads"], merged["n_kv_heads"]
        if dim % n_heads:
            fail("model.n_heads", n_heads, f"must divide model.dim={dim}")
        if n_heads % n_kv_heads:
            fail("model.n_kv_heads", n_kv_heads, f"must divide model.n_heads={n_heads}")
        try:
            return dataclasses.replace(get_preset(self.preset), **changes)
        except (ValueError, TypeError) as err:
            set_ = " ".join(f"model.{k}={v}" for k, v in changes.items())
            raise ConfigError(f"model={self.preset} {set_} is not a valid model: {first_line(err)}") from None

    def _pretrained_shape(self, shape: ModelConfig) -> ModelConfig:
        """``shape`` (the pretrained weights'), refusing a field set to another value; ``max_seq_len`` may change."""
        for name in MODEL_OVERRIDE_FIELDS:
            value = getattr(self, name)
            if value is not None and name != "max_seq_len" and value != getattr(shape, name):
                fail(
                    f"model.{name}",
                    value,
                    f"model.init_from={self.init_from} has {name}={getattr(shape, name)}; "
                    f"remove model.{name} (the shape comes from the pretrained weights)",
                )
        if self.max_seq_len is not None:
            shape = dataclasses.replace(shape, max_seq_len=self.max_seq_len)
        return shape


@dataclass
class _ScheduleName:
    """``schedule.name``, a base of its own so it leads :class:`ScheduleSection` (in YAML and messages)."""

    name: str = (
        "auto"  # auto (single with 1 process, sysx with several) | single | reference | sysx | gpipe | 1f1b | ...
    )


@dataclass
class PipelineKeys:
    """The ``schedule.*`` keys the pipeline schedules read (which one reads which:
    :mod:`sysx.config.schedule_keys`); :class:`sysx.runtime.PipelineOptions` holds them too."""

    # forward stages per rank (null: sysx cfg 2-3 with split null and >= 12 flat layers a rank one block
    # per stage, else 2, else 1)
    stages_per_rank: int | None = None
    split: int | None = (
        None  # sysx: backward sub-stages per forward stage d (null: 1 at one block per stage, else 3 when
        # possible (2 with cfg=1), else 2, else 1)
    )
    cfg: int = 3  # sysx ablation (paper Table 3): 0 decoupled passes, 1 +sub-stages, 2 +async ckpts, 3 +async optimizer
    param_buffers: int = 2  # device parameter buffers per rank (2 = current + prefetch)
    stage_sizes: list[int] | None = None  # manual partition: flat layers (embedding, blocks, head) per forward stage
    verify_transfers: bool | None = (
        None  # a header checked before every p2p message (null: on with gloo, off with NCCL)
    )
    timeout_s: float = 300.0  # longest wait on a peer before an error naming the rank, the op and the peer
    # keep each micro-batch's activations from its forward to its backward instead of recomputing the
    # stage (gpipe, 1f1b, interleaved_1f1b, mobius: their checkpoints stay on the rank); ~1/4 less compute
    keep_activations: bool = False
    # sysx cfg 3: the iteration's last optimizer step (sub-stage 0.0, the last gradients home) shared by
    # every rank of its owner's node, each stepping a shard of its master and Adam state (issue 27);
    # null: on where it runs (sysx cfg 3, one replica, optim.offload=host), false: off
    spread_last_step: bool | None = None
    # sysx with the Head a stage of its own (one block per stage): of each step's micro-batches, how many
    # have the Head's input gradient computed by the Head's forward (on its rank, right after the forward,
    # sent from there); the Head's backward sub-stage then recomputes for its weight gradient only, work
    # off the rank that leads the backward ring. null: 3/4 of them there, else 0 (issue 27)
    head_input_grad: int | None = None
    # sysx: each micro-batch's backward in this many parts of its rows (train.micro_batch_size a multiple),
    # each recomputed from its rows of the one checkpoint: a micro-batch's backward hops from rank to rank
    # a part at a time, which shortens the pipeline's fill and drain at long sequences. null: 2 with the
    # Head a stage of its own and an even micro-batch size, else 1 (issue 27)
    backward_parts: int | None = None

    def validate(self) -> None:
        """Ranges of the pipeline keys."""
        if self.head_input_grad is not None:
            check_int("schedule.head_input_grad", self.head_input_grad, 0)
        if self.backward_parts is not None:
            check_int("schedule.backward_parts", self.backward_parts, 1)
        if not isinstance(self.keep_activations, bool):
            fail("schedule.keep_activations", self.keep_activations, "must be true or false")
        if self.spread_last_step is not None and not isinstance(self.spread_last_step, bool):
            fail("schedule.spread_last_step", self.spread_last_step, "must be null, true or false")
        for key in ("stages_per_rank", "split"):
            if getattr(self, key) is not None:
                check_int(f"schedule.{key}", getattr(self, key), 1)
        if self.cfg not in SYSX_CFGS:
            fail(
                "schedule.cfg",
                self.cfg,
                f"allowed: {', '.join(map(str, SYSX_CFGS))} (sysx ablation configs of the paper's Table 3)",
            )
        check_int("schedule.param_buffers", self.param_buffers, 1)
        if self.stage_sizes is not None and (not self.stage_sizes or min(self.stage_sizes) < 1):
            fail(
                "schedule.stage_sizes",
                list(self.stage_sizes),
                "must be positive layer counts, one per forward stage, e.g. [3,3]",
            )
        check_positive("schedule.timeout_s", self.timeout_s, " seconds")


@dataclass
class ScheduleSection(PipelineKeys, _ScheduleName):
    """``schedule=<name>``: how a training step is executed (``reference``: one process, plain loop;
    ``single``: the one-device sliding window; ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``mobius``,
    ``sysx``: one process per device, see :mod:`sysx.runtime`; ``auto``: sysx with several processes,
    single with one). The other keys are read by the pipeline schedules only (:class:`PipelineKeys`)."""

    # choose stages/rank, split, cfg, buffers, micro-batch split, optim.workers by profile + simulation
    # (null: true for schedule=auto with several processes unless stages_per_rank, split or
    # stage_sizes are given; false otherwise)
    tune: bool | None = None

    def validate(self) -> None:
        """The name, the pipeline keys' ranges and ``tune``."""
        if not self.name:
            fail("schedule.name", repr(self.name), "give a schedule name")
        super().validate()
        if self.tune is not None and not isinstance(self.tune, bool):
            fail(
                "schedule.tune",
                repr(self.tune),
                "must be true, false or null (true for schedule=auto with several processes)",
            )


def check_host_adam(backend: str, rollback: str, workers: int | None) -> None:
    """The host CPU Adam keys (``optim.backend``, ``optim.rollback``, ``optim.workers``)."""
    check_choice("optim.backend", backend, OPTIM_BACKENDS)
    check_choice("optim.rollback", rollback, ROLLBACKS)
    if workers is not None:
        check_int("optim.workers", workers, 1)


@dataclass
class OptimSection:
    """``optim=adamw``: AdamW with linear warmup and cosine decay to :attr:`final_lr` over ``train.steps``."""

    name: str = "adamw"  # the optimizer (optim=adamw)
    lr: float = 0.001  # peak learning rate, after warmup
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's moment decay rates
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.1  # decoupled weight decay, on the weight matrices (optim.decay_norms for the 1-D ones)
    decay_norms: bool = False  # true: decay the 1-D parameters (norm weights) too, sysx's old behaviour
    warmup_steps: int = 50  # linear warmup steps
    min_lr: float | None = None  # the cosine decay's floor (null: lr * min_lr_ratio, so it follows lr)
    min_lr_ratio: float = 0.1  # the floor as a fraction of lr when min_lr is null
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    backend: str = "auto"  # host CPU Adam (pipeline schedules): auto (DeepSpeed, else torch) | deepspeed | torch
    rollback: str = (
        "undo"  # undoing a step on overflow: undo | snapshot | exact | auto (exact if host memory allows, else undo)
    )
    workers: int | None = None  # optimizer threads per rank (null: from the core plan)
    speculate: str = "auto"  # step before validating: auto (while recent steps were clean) | always | never
    speculate_after: int = SPECULATE_AFTER  # auto: clean steps after a clipped/overflowed one before speculating again
    placement: str = (
        "auto"  # Adam updates per sub-stage on the CPU or the device lane: auto | cpu | split (sysx.optim.placement)
    )
    offload: str = "host"  # where the fp32 master, m and v live between steps: host | nvme (files under nvme_dir)
    nvme_dir: str | None = None  # a directory on a local NVMe drive (required with offload=nvme)
    nvme_engine: str = "auto"  # the state files' I/O: auto | aio | threads

    def validate(self) -> None:
        """Choices and ranges of ``optim.*``."""
        check_choice("optim.name", self.name, OPTIMIZERS)
        check_positive("optim.lr", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            fail("optim.betas", list(self.betas), "must be two numbers in [0, 1), e.g. [0.9,0.95]")
        check_positive("optim.eps", self.eps)
        if self.weight_decay < 0:
            fail("optim.weight_decay", self.weight_decay, "must be >= 0")
        if not isinstance(self.decay_norms, bool):
            fail("optim.decay_norms", self.decay_norms, "must be true or false (true: decay the norm weights too)")
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            fail(
                "optim.min_lr",
                self.min_lr,
                f"must be between 0 and optim.lr={self.lr} (or null: lr * optim.min_lr_ratio)",
            )
        if not 0 <= self.min_lr_ratio <= 1:
            fail("optim.min_lr_ratio", self.min_lr_ratio, "must be between 0 and 1")
        if self.grad_clip < 0:
            fail("optim.grad_clip", self.grad_clip, "must be >= 0 (0 = no clipping)")
        check_host_adam(self.backend, self.rollback, self.workers)
        check_choice("optim.speculate", self.speculate, SPECULATE_MODES)
        check_int("optim.speculate_after", self.speculate_after, 0)
        check_choice("optim.placement", self.placement, PLACEMENTS)
        check_offload(self.offload, self.nvme_dir, self.nvme_engine)

    @property
    def final_lr(self) -> float:
        """The learning rate the cosine decay ends at: ``min_lr``, or ``lr * min_lr_ratio`` when it is null."""
        return self.lr * self.min_lr_ratio if self.min_lr is None else self.min_lr


@dataclass
class DataSection:
    """``data=default`` (stdlib byte corpus) or ``data=file data.path=<tokens.bin>``."""

    name: str = "default"  # default (byte-level stdlib corpus, no download) | file
    path: str | None = None  # the token file (.bin) of data=file
    dtype: str | None = None  # uint16 | uint32, for a .bin without metadata (e.g. nanoGPT's GPT-2 files)
    vocab_size: int | None = None  # token ids of a .bin without metadata

    def validate(self) -> None:
        """The source, and the file's format when it has no metadata."""
        check_choice("data.name", self.name, DATA_SOURCES)
        if self.dtype is not None:
            check_choice("data.dtype", self.dtype, TOKEN_DTYPES)
        if self.vocab_size is not None:
            check_int("data.vocab_size", self.vocab_size, 1)
        if self.name == "file" and not self.path:
            fail("data.path", self.path, "data=file needs the token file, e.g. data.path=/data/tokens.bin")
        if self.name == "default":
            # data=default trains on the built-in corpus; a file key set beside it would be silently ignored
            for key in ("path", "dtype", "vocab_size"):
                if getattr(self, key) is not None:
                    fail(
                        f"data.{key}",
                        getattr(self, key),
                        "data=default ignores it; add data=file to train on a token file",
                    )


@dataclass
class TrainSection:
    """Step count and batch shape: a step sees ``micro_batches * micro_batch_size * seq_len`` tokens."""

    steps: int = 500  # optimizer steps
    micro_batch_size: int = 8  # sequences per micro-batch
    micro_batches: int = 2  # micro-batches per step and replica (gradient accumulation)
    seq_len: int = 128  # tokens per sequence
    resume: str = "auto"  # auto (the latest checkpoint in checkpoint.dir, if any) | none | <checkpoint path>

    def validate(self) -> None:
        """Every count is at least 1; ``resume`` is auto, none or a path."""
        for key in ("steps", "micro_batch_size", "micro_batches", "seq_len"):
            check_int(f"train.{key}", getattr(self, key), 1)
        if not str(self.resume).strip():
            fail("train.resume", repr(self.resume), "give auto, none or a checkpoint path")


@dataclass
class ParallelSection:
    """``parallel.*``: the job's data-parallel replicas of one pipeline (:mod:`sysx.replicas`; world = replicas
    x pipeline ranks, global batch = replicas x micro-batches x their size) and its ranks' CPUs."""

    # data-parallel replicas of the pipeline, each on its own micro-batches, each stepping 1/replicas of the optimizer
    replicas: int | None = None  # (null: 1, or schedule.tune's choice); world size = replicas x pipeline ranks
    # pin each rank, its optimizer workers included, to its own slice of the node's CPUs (as the tune measures it)
    bind_cores: str = "auto"  # auto (where the job's ranks fill the node: sysx.optim.cores.bind_choice) | true | false

    def validate(self) -> None:
        """``replicas`` is null or an integer >= 1; ``bind_cores`` auto, true or false."""
        if self.replicas is not None:
            check_int("parallel.replicas", self.replicas, 1)
        if str(self.bind_cores).lower() not in BIND_CORES:
            fail("parallel.bind_cores", self.bind_cores, "give auto, true or false")

    @property
    def count(self) -> int:
        """The replicas of the job (null counts as 1)."""
        return 1 if self.replicas is None else self.replicas


@dataclass
class CheckpointSection:
    """Saving training state: every ``every`` steps (0 = only at the end, which always saves) into
    ``dir`` (null: ``<run_dir>/checkpoints``), keeping the newest ``keep``."""

    every: int = 0  # save every N steps (0 = only at the end, which always saves)
    dir: str | None = None  # where checkpoints go (null: <run_dir>/checkpoints)
    keep: int = 2  # newest checkpoints kept
    export_hf: bool = False  # also write the final weights as a Hugging Face folder (<run_dir>/hf)
    on_signal: bool = False  # on SIGINT/SIGTERM finish the step and save before stopping

    def validate(self) -> None:
        """Counts and the folder."""
        check_int("checkpoint.every", self.every, 0)
        check_int("checkpoint.keep", self.keep, 1)
        if self.dir is not None and not str(self.dir).strip():
            fail("checkpoint.dir", repr(self.dir), "give a folder, or null for <run_dir>/checkpoints")


@dataclass
class LossScaleSection:
    """Dynamic loss scaling for ``precision=fp16``."""

    init: float = 65536.0  # starting scale (precision=fp16 only)
    growth_factor: float = 2.0  # multiply the scale by this after growth_interval clean steps
    growth_interval: int = 1000  # steps without overflow before the scale grows
    backoff: float = 0.5  # multiply the scale by this on overflow (the step is skipped)
    min: float = 1.0  # stop with an error if the scale would fall below this

    def validate(self) -> None:
        """A positive scale that grows, backs off and has a floor below its start."""
        check_positive("loss_scale.init", self.init)
        if not self.growth_factor >= 1:
            fail("loss_scale.growth_factor", self.growth_factor, "must be >= 1")
        check_int("loss_scale.growth_interval", self.growth_interval, 1)
        if not 0 < self.backoff < 1:
            fail("loss_scale.backoff", self.backoff, "must be in (0, 1)")
        if not 0 < self.min <= self.init:
            fail("loss_scale.min", self.min, f"must be in (0, loss_scale.init={self.init}]")


@dataclass
class LogSection:
    """Console logging: a line every ``every`` steps; a progress bar on rank 0 when on a terminal.
    Every step's metrics go to each of ``backends`` (:mod:`sysx.tracking`), written by rank 0."""

    every: int = 50  # print a line every N steps (the backends get every step)
    progress: bool = True  # progress bar on rank 0 when stdout is a terminal
    # where each step's metrics go: jsonl (run_dir/metrics.jsonl), tensorboard (run_dir/tensorboard), wandb (run_dir/wandb)
    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "sysx"  # W&B project
    wandb_name: str | None = None  # W&B run name (null: the run_dir's name)
    wandb_mode: str = "auto"  # offline | online | auto (WANDB_MODE if set, else online with an API key, else offline)

    def validate(self) -> None:
        """A line at least every step; known backends, each once, whose packages are installed."""
        check_int("log.every", self.every, 1)
        shown = "[" + ",".join(self.backends) + "]"
        for name in self.backends:
            check_choice("log.backends", shown, list(LOG_BACKENDS), item=name)
            if self.backends.count(name) > 1:
                fail("log.backends", shown, f"{name} is given twice; name each backend once")
            package = LOG_BACKENDS[name]
            if package is not None:
                check_installed(f"log.backends contains {name}", *package)
        check_choice("log.wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.wandb_project.strip():
            fail("log.wandb_project", repr(self.wandb_project), "give a W&B project name")


@dataclass
class EvalSection:
    """Validation loss over ``batches`` micro-batches of the val split every ``every`` steps (0 = off)."""

    every: int = 100  # validation loss every N steps (0 = off)
    batches: int = 4  # micro-batches per evaluation

    def validate(self) -> None:
        """``every`` may be 0 (off); at least one batch."""
        check_int("eval.every", self.every, 0)
        check_int("eval.batches", self.batches, 1)


@dataclass
class SingleSection:
    """``single.*``: the sliding window of ``schedule=single`` (AdaWS). Every automatic choice can be
    pinned by hand; ``0`` / ``auto`` lets the planner decide from the measured hardware and the model
    (AdaWS §3.2). The global batch is always ``train.micro_batch_size * train.micro_batches``
    sequences: the planner only changes how it is cut into chunks and rounds
    (``conf/schedule/single.yaml`` documents each key)."""

    device_memory_gb: float = 0.0  # hard device budget in GiB (0 = all free device memory)
    host_memory_gb: float = 0.0  # hard host budget in GiB (0 = all available host memory)
    micro_batch_size: int = 0  # sequences per chunk, the unit of compute (0 = auto)
    round_sequences: int = 0  # sequences per round X, AdaWS 3.2.2 (0 = auto); divides the global batch
    window: int = 0  # blocks resident on the device W, AdaWS 3.2.3 (0 = auto)
    seq_chunk: int = 0  # tokens per sequence chunk inside each block (0 = auto); divides train.seq_len
    policy: str = "dp"  # saved activations: dp (AdaWS DP) | pyao (IQR rule) | a fixed level name or id
    compress: bool = False  # int8-compress offloaded activations (PyAO 4.3)
    keep_graph: bool = False  # when every block fits: keep each forward's autograd graph (no recompute)
    optimizer_overlap: str = "auto"  # auto | backward (step as grads arrive) | forward (after the norm)
    hardware: str = "measure"  # measure (cached per machine) | remeasure | a preset of ASSUMED_HARDWARE (planning only)
    print_plan: bool = True  # print the plan and its reasons at start

    def validate(self) -> None:
        """Budgets and counts are >= 0 (0 = automatic); policy, overlap and hardware are known."""
        if self.device_memory_gb < 0:
            raise ConfigError(
                f"single.device_memory_gb={self.device_memory_gb} must be >= 0 (0 = all free device memory)"
            )
        if self.host_memory_gb < 0:
            raise ConfigError(
                f"single.host_memory_gb={self.host_memory_gb} must be >= 0 (0 = all available host memory)"
            )
        for name in ("micro_batch_size", "round_sequences", "window"):
            if getattr(self, name) < 0:
                raise ConfigError(f"single.{name}={getattr(self, name)} must be >= 0 (0 = automatic)")
        if not isinstance(self.seq_chunk, int) or isinstance(self.seq_chunk, bool) or self.seq_chunk < 0:
            raise ConfigError(
                f"single.seq_chunk={self.seq_chunk} must be a whole number of tokens >= 0 that divides "
                f"train.seq_len (0 = automatic)"
            )
        policy = str(self.policy)
        if policy not in POLICIES and not (policy.isdigit() and int(policy) < len(SAVE_LEVELS)):
            raise ConfigError(
                f"single.policy={self.policy} is not valid; allowed: {', '.join(POLICIES)} "
                f"or a level 0..{len(SAVE_LEVELS) - 1}"
            )
        if self.optimizer_overlap not in OVERLAPS:
            raise ConfigError(
                f"single.optimizer_overlap={self.optimizer_overlap} is not valid; allowed: {', '.join(OVERLAPS)}"
            )
        if self.hardware not in HARDWARE:
            raise ConfigError(f"single.hardware={self.hardware} is not valid; allowed: {', '.join(HARDWARE)}")


@dataclass
class ProfileSection:
    """``profile.*``: what a run records about its own time (``profiling/README.md``). Steps are
    0-based indices ``[first, last]``, both included."""

    timeline_steps: list[int] | None = None  # record these steps: timeline.json, timeline.png, plan.png in run_dir
    nvtx: bool = False  # NVTX ranges on every op, copy and optimizer job (also SYSX_NVTX=1)
    nsys_steps: list[int] | None = None  # CUDA profiler capture range for nsys --capture-range=cudaProfilerApi

    def validate(self) -> None:
        """Each window is two steps ``0 <= first <= last`` or null."""
        for key in ("timeline_steps", "nsys_steps"):
            value = getattr(self, key)
            if value is not None and (len(value) != 2 or not 0 <= value[0] <= value[1]):
                fail(
                    f"profile.{key}",
                    list(value),
                    "give [first,last] step indices with 0 <= first <= last, e.g. [3,5], or null (off)",
                )


@dataclass
class EmulateSection:
    """``emulate.*``: the GPU cluster that ``device=emulated`` stands in for (:mod:`sysx.emulate`).

    Each rank acts as a ``gpu`` of :data:`~sysx.config.choices.ASSUMED_HARDWARE` in nodes of
    ``cpu`` (:data:`~sysx.config.choices.ASSUMED_CPUS`) linked by ``net``
    (:data:`~sysx.config.choices.ASSUMED_NETWORKS`), training a model whose costs are those of the
    preset ``model`` at ``seq_len`` x ``micro_batch_size`` tokens per micro-batch (null: the job's
    ``train.*``), while the tensors that really move are the job's small model with the preset's
    layer count. Every modelled duration is multiplied by ``time_scale`` on the wall clock (and
    reported divided by it). The first ``warmup_steps`` steps are not measured; a measurement is
    refused when the real work made the emulated timeline late by more than ``max_late`` of it.
    ``op_host_us``: the real host time of one executor instruction (null: the figure cached with
    this machine's hardware profile, 0 when none is); the plan and the pacer add it, divided by
    ``time_scale``, so a layout of thousands of messages is not refused for its own Python work.
    ``disk``: the node's NVMe drives (:data:`~sysx.config.choices.ASSUMED_DISKS`), what
    ``optim.offload=nvme`` reads and writes; ``host_memory_gib``: the node's RAM (null: the ``cpu``
    profile's).
    """

    gpu: str = "v100"  # GPU profile each rank acts as (ASSUMED_HARDWARE)
    cpu: str = "epyc7452"  # host CPU profile (ASSUMED_CPUS)
    net: str = "pcie3_ib_hdr"  # GPUs per node and links (ASSUMED_NETWORKS)
    model: str = "llama2_10b"  # the preset whose costs are emulated
    seq_len: int | None = None  # tokens per sequence of the emulated costs (null: train.seq_len)
    micro_batch_size: int | None = (
        None  # sequences per micro-batch of the emulated costs (null: train.micro_batch_size)
    )
    time_scale: float = 0.1  # wall seconds per modelled second (0.1: 10x slower)
    warmup_steps: int = 1  # steps left out of the measurement
    max_late: float = 0.05  # refuse the measurement when the timeline ran late by more than this fraction
    op_host_us: float | None = (
        None  # real host us per executor instruction the plan adds (null: this machine's cached figure)
    )
    disk: str = "nvme3x4"  # the node's NVMe drives (ASSUMED_DISKS)
    host_memory_gib: float | None = None  # the node's RAM (null: the cpu profile's)

    def validate(self) -> None:
        """Profiles and preset are known, counts >= 1, the scale > 0, the tolerance in (0, 1)."""
        from sysx.model import PRESETS  # torch: only when a config is validated, not for --help

        check_choice("emulate.gpu", self.gpu, list(ASSUMED_HARDWARE))
        check_choice("emulate.cpu", self.cpu, list(ASSUMED_CPUS))
        check_choice("emulate.net", self.net, list(ASSUMED_NETWORKS))
        check_choice("emulate.disk", self.disk, list(ASSUMED_DISKS))
        if self.host_memory_gib is not None:
            check_positive("emulate.host_memory_gib", self.host_memory_gib, " (GiB of RAM per node), or null")
        check_choice("emulate.model", self.model, [p for p in PRESETS if p != "tiny"])
        for key in ("seq_len", "micro_batch_size"):
            if getattr(self, key) is not None:
                check_int(f"emulate.{key}", getattr(self, key), 1)
        check_positive(
            "emulate.time_scale", self.time_scale, " (0.1: the emulated cluster runs 10x slower than modelled)"
        )
        check_int("emulate.warmup_steps", self.warmup_steps, 0)
        if not 0 < self.max_late < 1:
            fail("emulate.max_late", self.max_late, "must be in (0, 1), e.g. 0.05 (5% of the iteration)")
        if self.op_host_us is not None and not self.op_host_us >= 0:
            fail("emulate.op_host_us", self.op_host_us, "must be >= 0 microseconds, or null for this machine's figure")

    def preset_layers(self) -> int:
        """Transformer blocks of the emulated preset (the job's model gets as many)."""
        from sysx.model import get_preset

        return get_preset(self.model).n_layers
