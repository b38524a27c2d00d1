"""Model shapes: the ``ModelConfig`` dataclass and the named presets.

Presets: ``tiny`` (byte-level, a few steps per second on 2 CPU cores); ``llama2_7b``, ``llama3_8b``
and ``llama3_1_8b`` (the published Meta shapes); ``llama2_10b`` ... ``llama2_110b`` (the SysX paper's
Table 2, query heads from :func:`choose_n_heads`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

ROPE_TYPES = ("default", "llama3")
# The Llama-3.1 scaling fields: each is required with rope_type=llama3 and must be left unset otherwise.
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-2/3 decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # RoPE scaling as HF ``rope_parameters``: ``default`` (none) or ``llama3`` (Llama-3.1: ``factor``,
    # ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                f"pick n_heads among the divisors of dim"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                f"grouped-query attention needs n_kv_heads to divide n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} (dim // n_heads) must be even for RoPE")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        """``rope_type`` is known and its fields are all given (llama3) or all unset (default)."""
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_type={self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        given = [name for name in LLAMA3_ROPE_FIELDS if getattr(self, name) is not None]
        if self.rope_type == "default":
            if given:
                raise ValueError(
                    f"ModelConfig: {', '.join(given)} set but rope_type='default' ignores them; "
                    f"set rope_type='llama3' or leave them unset"
                )
            return
        missing = [name for name in LLAMA3_ROPE_FIELDS if name not in given]
        if missing:
            raise ValueError(
                f"ModelConfig: rope_type='llama3' needs {', '.join(missing)} (Llama-3.1: rope_factor=8, "
                f"rope_low_freq_factor=1, rope_high_freq_factor=4, rope_original_max_len=8192)"
            )
        factor, low, high = self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
            raise ValueError(f"ModelConfig.rope_factor must be a number >= 1, got {factor!r}")
        if not (isinstance(low, (int, float)) and low > 0 and isinstance(high, (int, float)) and high > low):
            raise ValueError(f"ModelConfig: rope_high_freq_factor={high!r} must be > rope_low_freq_factor={low!r} > 0")
        n = self.rope_original_max_len
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"ModelConfig.rope_original_max_len must be a positive int, got {n!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``dim // n_heads``."""
        return self.dim // self.n_heads

    def to_json(self) -> str:
        """The config as a JSON object (what checkpoints store)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Build a config from a dict of its fields; unknown or missing keys are a clear error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; known fields: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"ModelConfig: cannot build from {data!r}: {err}") from err

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


def choose_n_heads(dim: int, n_kv_heads: int, target_head_dim: int = 128) -> int:
    """Query-head count for a shape that only gives ``dim`` and ``n_kv_heads`` (SysX Table 2).

    Among the ``n_heads`` that divide ``dim``, are multiples of ``n_kv_heads`` and give a
    ``head_dim`` that is a multiple of 8, return the one whose ``head_dim`` is closest to
    ``target_head_dim`` (the smaller head_dim on a tie).
    """
    best: tuple[int, int, int] | None = None
    for n_heads in range(n_kv_heads, dim + 1, n_kv_heads):
        if dim % n_heads or (dim // n_heads) % 8:
            continue
        head_dim = dim // n_heads
        key = (abs(head_dim - target_head_dim), head_dim, n_heads)
        if best is None or key < best:
            best = key
    if best is None:
        raise ValueError(f"no n_heads fits dim={dim} with n_kv_heads={n_kv_heads} and head_dim % 8 == 0")
    return best[2]


def _table2(n_layers: int, dim: int, ffn_dim: int, n_kv_heads: int, n_heads: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32000,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    )


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=352,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=512,
    ),
    "llama2_7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    "llama3_8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3_1_8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=131072,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
    ),
    # SysX paper, Table 2: (l, d, d_FFN, # KV heads) from the table; n_heads = choose_n_heads(d, kv).
    "llama2_10b": _table2(48, 4096, 10880, 2, n_heads=32),  # head_dim 128
    "llama2_19b": _table2(48, 5632, 14976, 4, n_heads=44),  # head_dim 128
    "llama2_30b": _table2(96, 5120, 13632, 4, n_heads=40),  # head_dim 128
    "llama2_40b": _table2(96, 5888, 15680, 4, n_heads=32),  # head_dim 184 (46 heads of 128 are not a multiple of 4)
    "llama2_52b": _table2(96, 6656, 17728, 8, n_heads=64),  # head_dim 104 (52 heads of 128 are not a multiple of 8)
    "llama2_69b": _table2(96, 7680, 20480, 8, n_heads=64),  # head_dim 120 (60 heads of 128 are not a multiple of 8)
    "llama2_88b": _table2(192, 6144, 16384, 16, n_heads=48),  # head_dim 128
    "llama2_110b": _table2(192, 6912, 18432, 16, n_heads=48),  # head_dim 144 (54 heads of 128 are not a multiple of 16)
}

# Nominal sizes (parameters) the presets are named after; tests compare param_count with them.
NOMINAL_PARAMS: dict[str, float] = {
    "llama2_7b": 6.74e9,
    "llama3_8b": 8.03e9,
    "llama3_1_8b": 8.03e9,
    "llama2_10b": 10e9,
    "llama2_19b": 19e9,
    "llama2_30b": 30e9,
    "llama2_40b": 40e9,
    "llama2_52b": 52e9,
    "llama2_69b": 69e9,
    "llama2_88b": 88e9,
    "llama2_110b": 110e9,
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; an unknown name is a clear error listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
