"""Composing a job configuration from ``conf/`` with Hydra, reading and writing it, and turning
every Hydra/OmegaConf problem into one :class:`ConfigError` line naming the key, the value and
what is allowed.

Composition uses Hydra's compose API (``initialize_config_dir`` + ``compose``), which creates no
files and never changes the working directory; see :mod:`sysx.train` for why.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from sysx.config.checks import ConfigError, first_line
from sysx.config.overrides import refuse_hydra_keys
from sysx.config.schema import SysxConfig, validate

SCHEMA_NAME = "sysx_schema"
CONFIG_NAME = "config"
GROUPS = ("model", "schedule", "optim", "data")


def register_schema() -> None:
    """Register :class:`SysxConfig` in Hydra's ConfigStore as ``sysx_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=SysxConfig)


def config_dir() -> Path:
    """The ``conf/`` directory: the repository's in a checkout, else the copy shipped in the wheel."""
    package = Path(__file__).resolve().parents[1]  # sysx/
    root = package.parent
    if (root / "pyproject.toml").is_file() and (root / "conf" / f"{CONFIG_NAME}.yaml").is_file():
        return root / "conf"  # a source checkout (or an editable install)
    return package / "conf"  # the wheel ships conf/ as the package sysx.conf


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
    refuse_hydra_keys(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), job_name="sysx", version_base="1.3"):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
        OmegaConf.resolve(cfg)
    except (
        HydraException,
        OmegaConfBaseException,
        ValueError,
    ) as err:  # Hydra raises ValueError for some bad overrides
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


def _describe_type(path: str, value: str = "") -> str:
    """What a key accepts, in words (``an integer``, ``a list of numbers``, ``a section: a, b``);
    a list of strings given one plain ``value`` gets that value in brackets as the example."""
    node = _schema_node(path)
    if dataclasses.is_dataclass(node):
        return f"a section with keys {', '.join(_keys_of(path))} (set them one by one, e.g. {path}.{_keys_of(path)[0]}=...)"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    origin, args = get_origin(node), [a for a in get_args(node) if a is not type(None)]
    if origin is list and args:
        plain = args[0] is str and value and not value.startswith("[")
        example = f"[{value}]" if plain else "[0.9,0.95]"
        return f"a list of {words.get(args[0], str(args[0])).split(' ', 1)[-1]}s, e.g. {example}"
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
        return first_line(err)
    if isinstance(err, OverrideParseException):
        return f"cannot parse override {err.override!r}: {first_line(err)} (use key=value, e.g. train.steps=100)"

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
            return f"{shown}={value} is not valid: expected {_describe_type(key, str(value))}"
        return f"{key}={value}: {first_line(cause)}"

    match = re.search(r"Could not (?:override|append to config)[^']*'([^']+)'", str(err))
    if match:
        return _unknown_key(match.group(1))
    if "Ambiguous value" in str(err):
        return f"{first_line(err)}: a sweep (a,b) needs -m (--multirun), one job per point; or give one value"
    return f"{first_line(err)} (overrides: {' '.join(overrides)})"


def _unknown_key(key: str) -> str:
    parent = key.rpartition(".")[0]
    where = f" in {parent}" if parent else " at the top level"
    return f"unknown key {key!r}; valid keys{where}: {', '.join(_keys_of(parent))}"


def _check_keys(node: Any, schema: Any, prefix: str = "") -> None:
    """Reject keys the schema does not have (``+key=...``) and sections or keys removed (``~key``)."""
    if not dataclasses.is_dataclass(schema):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    hints = get_type_hints(schema)
    for key in node:
        if key not in names:
            raise ConfigError(_unknown_key(prefix + str(key)))
    for name in names:
        if name not in node:
            raise ConfigError(
                f"{prefix}{name} was removed; every key is needed, set a value instead (e.g. {prefix}{name}=...)"
            )
        if dataclasses.is_dataclass(hints[name]):
            _check_keys(node[name], hints[name], f"{prefix}{name}.")
