"""The configuration of a sysx job: typed schema, composition from ``conf/`` and validation.

The YAML files in ``conf/`` (``config.yaml`` + groups ``model/``, ``schedule/``, ``optim/``,
``data/``) are composed by Hydra on top of :class:`SysxConfig`, which is registered in Hydra's
ConfigStore as ``sysx_schema`` and is the first entry of ``config.yaml``'s defaults list. The schema
makes every node typed and closed: a value of the wrong type or a key that does not exist is
rejected while composing. :func:`validate` then checks ranges and choices. Every problem becomes a
:class:`ConfigError` whose message is one line naming the key, the value and what is allowed.

Composition uses Hydra's compose API (``initialize_config_dir`` + ``compose``), which creates no
files and never changes the working directory; see :mod:`sysx.train` for why.

The dataclasses are also the programmatic API: ``SysxConfig(train=TrainConfig(steps=5))`` is a
complete configuration for library users and tests, with the same defaults as ``conf/``.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from sysx.single.settings import SingleSection, validate_single

if TYPE_CHECKING:
    from sysx.model import ModelConfig

PRECISIONS = ("fp32", "bf16", "fp16")
DATA_SOURCES = ("default", "file")
TOKEN_DTYPES = ("uint16", "uint32")
OPTIMIZERS = ("adamw",)
SCHEMA_NAME = "sysx_schema"
CONFIG_NAME = "config"
GROUPS = ("model", "schedule", "optim", "data")
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
)


class ConfigError(ValueError):
    """A configuration problem, described in one line that names the key, the value and the fix."""


# ----------------------------------------------------------------------------------------- schema


@dataclass
class ModelSection:
    """``model=<preset>``: a preset of :data:`sysx.model.PRESETS`; a field left ``None`` keeps the
    preset's value, a field that is set replaces it."""

    preset: str = "tiny"
    vocab_size: Optional[int] = None
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    max_seq_len: Optional[int] = None
    tie_embeddings: Optional[bool] = None


@dataclass
class ScheduleSection:
    """``schedule=<name>``: how a training step is executed (``reference``: one process, plain loop;
    ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``mobius``, ``sysx``: one process per device, see
    :mod:`sysx.runtime`; ``auto``: sysx with several processes). The other keys are read by the
    pipeline schedules only."""

    name: str = "auto"
    stages_per_rank: Optional[int] = None  # forward stages per rank (null: 2 when the model has enough layers, else 1)
    split: Optional[int] = None  # sysx: backward sub-stages per forward stage d (null: 2 when possible, else 1)
    cfg: int = 3  # sysx ablation (paper Table 3): 0 decoupled passes, 1 +sub-stages, 2 +async ckpts, 3 +async optimizer
    param_buffers: int = 2  # device parameter buffers per rank (2 = current + prefetch)
    stage_sizes: Optional[list[int]] = None  # manual partition: flat layers (embedding, blocks, head) per forward stage
    verify_transfers: Optional[bool] = None  # a header checked before every p2p message (null: on with gloo, off with NCCL)
    timeout_s: float = 300.0  # longest wait on a peer before an error naming the rank, the op and the peer


@dataclass
class OptimSection:
    """``optim=adamw``: AdamW with linear warmup and cosine decay to ``min_lr`` over ``train.steps``."""

    name: str = "adamw"
    lr: float = 0.003
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr: float = 0.0003
    grad_clip: float = 1.0
    backend: str = "auto"  # host CPU Adam (pipeline schedules): auto (DeepSpeed, else torch) | deepspeed | torch
    rollback: str = "undo"  # undoing a step on overflow: undo (Adam's arithmetic inverse) | snapshot (exact copy)
    workers: Optional[int] = None  # optimizer threads per rank (null: from the core plan)


@dataclass
class DataSection:
    """``data=default`` (stdlib byte corpus) or ``data=file data.path=<tokens.bin>``."""

    name: str = "default"
    path: Optional[str] = None
    dtype: Optional[str] = None  # uint16 | uint32, for a .bin without metadata (e.g. nanoGPT's GPT-2 files)
    vocab_size: Optional[int] = None  # likewise


@dataclass
class TrainSection:
    """Step count and batch shape: a step sees ``micro_batches * micro_batch_size * seq_len`` tokens."""

    steps: int = 500
    micro_batch_size: int = 8
    micro_batches: int = 2
    seq_len: int = 128


@dataclass
class LossScaleSection:
    """Dynamic loss scaling for ``precision=fp16``."""

    init: float = 65536.0
    growth_factor: float = 2.0
    growth_interval: int = 1000
    backoff: float = 0.5
    min: float = 1.0


@dataclass
class LogSection:
    """Console logging: a line every ``every`` steps; a progress bar on rank 0 when on a terminal."""

    every: int = 50
    progress: bool = True


@dataclass
class EvalSection:
    """Validation loss over ``batches`` micro-batches of the val split every ``every`` steps (0 = off)."""

    every: int = 100
    batches: int = 4


@dataclass
class SysxConfig:
    """The whole job configuration (``conf/config.yaml`` composed on this schema)."""

    model: ModelSection = field(default_factory=ModelSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    single: SingleSection = field(default_factory=SingleSection)
    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step (all micro-batches)."""
        return self.train.micro_batches * self.train.micro_batch_size * self.train.seq_len


def register_schema() -> None:
    """Register :class:`SysxConfig` in Hydra's ConfigStore as ``sysx_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=SysxConfig)


def config_dir() -> Path:
    """The ``conf/`` directory: the repository's in a checkout, else the copy shipped in the wheel."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "conf" / f"{CONFIG_NAME}.yaml").is_file():
        return root / "conf"  # a source checkout (or an editable install)
    return Path(__file__).parent / "conf"  # the wheel ships conf/ as the package sysx.conf


def group_options(group: str) -> list[str]:
    """The options of a config group, e.g. ``group_options("model") -> ["llama2_10b", ..., "tiny"]``."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


# ------------------------------------------------------------------------------------ composition


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra override strings (``key=value``, ``group=option``).

    Creates no files and does not change directory. Interpolations (``${now:...}``) are resolved.
    Raises :class:`ConfigError` with a one-line message for any composition problem.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_schema()
    overrides = list(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), job_name="sysx", version_base="1.3"):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # Hydra raises ValueError for some bad overrides
        raise ConfigError(_explain(err, overrides)) from None
    return cfg


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> SysxConfig:
    """Compose, resolve and validate: the typed configuration the trainers take."""
    cfg = compose_config(overrides)
    _check_keys(cfg, SysxConfig)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, SysxConfig)
    validate(obj)
    return obj


def resolve(cfg: SysxConfig) -> SysxConfig:
    """``cfg`` with interpolations such as ``run_dir: runs/${now:%Y%m%d-%H%M%S}`` filled in.

    :func:`load_config` already returns resolved configs; this is for dataclasses built in Python.
    Each process resolves ``${now:...}`` itself, so a multi-process trainer must take rank 0's
    ``run_dir`` (broadcast) rather than resolve it on every rank.
    """
    if not OmegaConf.has_resolver("now"):  # registered by Hydra on initialize; not when Hydra is unused
        OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True)
    node = OmegaConf.structured(cfg)
    OmegaConf.resolve(node)
    obj = OmegaConf.to_object(node)
    assert isinstance(obj, SysxConfig)
    return obj


def to_yaml(cfg: SysxConfig) -> str:
    """The configuration as YAML (what rank 0 writes to ``run_dir/config.yaml``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> SysxConfig:
    """Read back what :func:`to_yaml` wrote (type-checked against the schema, then validated)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SysxConfig), OmegaConf.create(text))
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, [])) from None
    _check_keys(merged, SysxConfig)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, SysxConfig)
    validate(obj)
    return obj


# ---------------------------------------------------------------------------------- error messages


def _override_for(key: str, overrides: list[str]) -> str | None:
    """The override string that sets ``key`` (``key=...``, ``+key=...``, ``++key=...``), if any."""
    base = re.sub(r"\[\d+\]$", "", key)
    for text in reversed(overrides):
        name = text.split("=", 1)[0].lstrip("+~")
        if name in (key, base):
            return text
    return None


def _schema_node(path: str) -> Any:
    """The schema's type at a dotted key: a dataclass for a section, else the field's type."""
    node: Any = SysxConfig
    for part in [p for p in re.sub(r"\[\d+\]", "", path).split(".") if p]:
        if not dataclasses.is_dataclass(node):
            return None
        hints = get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
    return node


def _keys_of(path: str) -> list[str]:
    """The valid child keys of a section of the schema (``""`` = top level)."""
    node = _schema_node(path)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _describe_type(path: str) -> str:
    """What a key accepts, in words (``an integer``, ``a list of numbers``, ``a section: a, b``)."""
    node = _schema_node(path)
    if dataclasses.is_dataclass(node):
        return f"a section with keys {', '.join(_keys_of(path))} (set them one by one, e.g. {path}.{_keys_of(path)[0]}=...)"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    origin, args = get_origin(node), [a for a in get_args(node) if a is not type(None)]
    if origin is list and args:
        return f"a list of {words.get(args[0], str(args[0])).split(' ', 1)[-1]}s, e.g. [0.9,0.95]"
    if origin is not None and len(args) == 1:  # Optional[X]
        return f"{words.get(args[0], str(args[0]))} or null"
    return words.get(node, "a valid value")


def _explain(err: BaseException, overrides: list[str]) -> str:
    """Turn a Hydra/OmegaConf exception into one line naming the key, the value and what is allowed."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException):
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if group in GROUPS:
            return f"{group}={option} is not a known {group}; allowed: {', '.join(group_options(group))}"
        return _first_line(err)
    if isinstance(err, OverrideParseException):
        return f"cannot parse override {err.override!r}: {_first_line(err)} (use key=value, e.g. train.steps=100)"

    cause: BaseException = err
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        key = cause.full_key
        text = _override_for(key, overrides)
        value = text.split("=", 1)[1] if text and "=" in text else cause.value
        if text and text.startswith("~"):
            return f"{text}: removing keys is not supported; set a value instead (e.g. {key}=...)"
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            return _unknown_key(key)
        if isinstance(cause, ValidationError):
            shown = re.sub(r"\[\d+\]$", "", key)
            return f"{shown}={value} is not valid: expected {_describe_type(key)}"
        return f"{key}={value}: {_first_line(cause)}"

    match = re.search(r"Could not (?:override|append to config)[^']*'([^']+)'", str(err))
    if match:
        return _unknown_key(match.group(1))
    if "Ambiguous value" in str(err):
        return f"{_first_line(err)}: sweeps (a,b) are not supported, give one value"
    return f"{_first_line(err)} (overrides: {' '.join(overrides)})"


def _unknown_key(key: str) -> str:
    parent = key.rpartition(".")[0]
    where = f" in {parent}" if parent else " at the top level"
    return f"unknown key {key!r}; valid keys{where}: {', '.join(_keys_of(parent))}"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _check_keys(node: Any, schema: Any, prefix: str = "") -> None:
    """Reject keys the schema does not have (``+key=...``) and sections or keys removed (``~key``)."""
    if not dataclasses.is_dataclass(schema):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    hints = get_type_hints(schema)
    for key in node.keys():
        if key not in names:
            raise ConfigError(_unknown_key(prefix + str(key)))
    for name in names:
        if name not in node:
            raise ConfigError(f"{prefix}{name} was removed; every key is needed, set a value instead (e.g. {prefix}{name}=...)")
        if dataclasses.is_dataclass(hints[name]):
            _check_keys(node[name], hints[name], f"{prefix}{name}.")


# ------------------------------------------------------------------------------------- validation


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value} is not valid: {allowed}")


def _check_choice(key: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        _fail(key, value, f"allowed: {', '.join(choices)}")


def _check_int(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        _fail(key, value, f"must be an integer >= {minimum}")


def validate(cfg: SysxConfig) -> None:
    """Check ranges and choices that types alone cannot; raise :class:`ConfigError` on the first problem."""
    _check_choice("precision", cfg.precision, PRECISIONS)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        _fail("device", cfg.device, "allowed: auto, cpu, cuda, cuda:<index>")
    _check_int("seed", cfg.seed, 0)
    if not str(cfg.run_dir).strip():
        _fail("run_dir", repr(cfg.run_dir), "give a directory path")

    t = cfg.train
    _check_int("train.steps", t.steps, 1)
    _check_int("train.micro_batch_size", t.micro_batch_size, 1)
    _check_int("train.micro_batches", t.micro_batches, 1)
    _check_int("train.seq_len", t.seq_len, 1)

    o = cfg.optim
    _check_choice("optim.name", o.name, OPTIMIZERS)
    if not o.lr > 0:
        _fail("optim.lr", o.lr, "must be > 0")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        _fail("optim.betas", list(o.betas), "must be two numbers in [0, 1), e.g. [0.9,0.95]")
    if not o.eps > 0:
        _fail("optim.eps", o.eps, "must be > 0")
    if o.weight_decay < 0:
        _fail("optim.weight_decay", o.weight_decay, "must be >= 0")
    _check_int("optim.warmup_steps", o.warmup_steps, 0)
    if not 0 <= o.min_lr <= o.lr:
        _fail("optim.min_lr", o.min_lr, f"must be between 0 and optim.lr={o.lr}")
    if o.grad_clip < 0:
        _fail("optim.grad_clip", o.grad_clip, "must be >= 0 (0 = no clipping)")
    _check_choice("optim.backend", o.backend, ("auto", "deepspeed", "torch"))
    _check_choice("optim.rollback", o.rollback, ("undo", "snapshot"))
    if o.workers is not None:
        _check_int("optim.workers", o.workers, 1)

    s = cfg.loss_scale
    if not s.init > 0:
        _fail("loss_scale.init", s.init, "must be > 0")
    if not s.growth_factor >= 1:
        _fail("loss_scale.growth_factor", s.growth_factor, "must be >= 1")
    _check_int("loss_scale.growth_interval", s.growth_interval, 1)
    if not 0 < s.backoff < 1:
        _fail("loss_scale.backoff", s.backoff, "must be in (0, 1)")
    if not 0 < s.min <= s.init:
        _fail("loss_scale.min", s.min, f"must be in (0, loss_scale.init={s.init}]")

    _check_int("log.every", cfg.log.every, 1)
    _check_int("eval.every", cfg.eval.every, 0)
    _check_int("eval.batches", cfg.eval.batches, 1)
    try:
        validate_single(cfg.single)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    _check_choice("data.name", cfg.data.name, DATA_SOURCES)
    if cfg.data.dtype is not None:
        _check_choice("data.dtype", cfg.data.dtype, TOKEN_DTYPES)
    if cfg.data.vocab_size is not None:
        _check_int("data.vocab_size", cfg.data.vocab_size, 1)
    if cfg.data.name == "file" and not cfg.data.path:
        _fail("data.path", cfg.data.path, "data=file needs the token file, e.g. data.path=/data/tokens.bin")

    sc = cfg.schedule
    if not sc.name:
        _fail("schedule.name", repr(sc.name), "give a schedule name")
    for key in ("stages_per_rank", "split"):
        if getattr(sc, key) is not None:
            _check_int(f"schedule.{key}", getattr(sc, key), 1)
    if sc.cfg not in (0, 1, 2, 3):
        _fail("schedule.cfg", sc.cfg, "allowed: 0, 1, 2, 3 (sysx ablation configs of the paper's Table 3)")
    _check_int("schedule.param_buffers", sc.param_buffers, 1)
    if sc.stage_sizes is not None and (not sc.stage_sizes or min(sc.stage_sizes) < 1):
        _fail("schedule.stage_sizes", list(sc.stage_sizes), "must be positive layer counts, one per forward stage, e.g. [3,3]")
    if not sc.timeout_s > 0:
        _fail("schedule.timeout_s", sc.timeout_s, "must be > 0 seconds")

    mcfg = model_config(cfg)
    if t.seq_len > mcfg.max_seq_len:
        _fail("train.seq_len", t.seq_len, f"must be <= model.max_seq_len={mcfg.max_seq_len} (or raise model.max_seq_len)")


def model_config(cfg: SysxConfig) -> ModelConfig:
    """The :class:`sysx.model.ModelConfig` of ``cfg.model``: the preset with the fields that are set."""
    from sysx.model import PRESETS, get_preset

    m = cfg.model
    _check_choice("model.preset", m.preset, sorted(PRESETS))
    changes = {name: getattr(m, name) for name in MODEL_OVERRIDE_FIELDS if getattr(m, name) is not None}
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        if name in changes:
            _check_int(f"model.{name}", changes[name], 1)
    merged = {**dataclasses.asdict(get_preset(m.preset)), **changes}
    dim, n_heads, n_kv_heads = merged["dim"], merged["n_heads"], merged["n_kv_heads"]
    if dim % n_heads:
        _fail("model.n_heads", n_heads, f"must divide model.dim={dim}")
    if n_heads % n_kv_heads:
        _fail("model.n_kv_heads", n_kv_heads, f"must divide model.n_heads={n_heads}")
    try:
        return dataclasses.replace(get_preset(m.preset), **changes)
    except (ValueError, TypeError) as err:
        set_ = " ".join(f"model.{k}={v}" for k, v in changes.items())
        raise ConfigError(f"model={m.preset} {set_} is not a valid model: {_first_line(err)}") from None
