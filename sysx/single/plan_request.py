"""What the single-GPU planner is asked (:class:`PlanRequest`), the model's parameter counts
(:class:`ModelSizes`), and how a refusal (:class:`PlanError`) and its byte counts read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sysx.machine.hardware import GiB
from sysx.memory.budget import ram_available_bytes
from sysx.model.config import ModelConfig
from sysx.model.flops import block_matmul_params, block_params
from sysx.single.act_policy import N_LEVELS, parse_level

if TYPE_CHECKING:
    from sysx.config import SingleSection, SysxConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlanError(ValueError):
    """The job cannot run within the budgets; the message gives the bytes needed and the fix."""


def gib(n: float) -> str:
    """``n`` bytes as ``'1.23 GiB'`` (``'12.3 MiB'`` below a tenth of a GiB)."""
    if abs(n) < 0.1 * GiB:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.2f} GiB"


def gib_up(n: float) -> str:
    """``n`` bytes in GiB rounded *up* to 2 significant digits (a budget that is certainly enough)."""
    x = n / GiB
    if x <= 0:
        return "0"
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return f"{math.ceil(x / step) * step:.10g}"


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for. ``0`` means automatic for ``chunk``, ``round_sequences``, ``window`` and
    ``seq_chunk`` (tokens per sequence chunk; ``seq_len`` = whole sequences)."""

    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step (never changed)
    precision: str = "fp32"
    device_budget_bytes: int | None = None  # None: the hardware's free device memory
    host_budget_bytes: int | None = None  # None: the hardware's free host memory
    chunk: int = 0
    round_sequences: int = 0
    window: int = 0
    seq_chunk: int = 0
    policy: str = "dp"
    compress: bool = False
    keep_graph: bool = False  # blocks keep their autograd graph when every block fits (whole sequences)
    grad_clip: float = 0.0
    optimizer_overlap: str = "auto"
    offload: str = "host"  # optim.offload: nvme keeps the fp32 master, m and v in files, not host memory
    use_measured_times: bool = False  # value sites by their measured time (profile) instead of the model

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of weights, activations and gradients on the device."""
        return DTYPES[self.precision]

    @property
    def param_bytes(self) -> int:
        """``|tau_param|``."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def top_option(self) -> int:
        """The largest save option the policy may use (``pyao``: the extra option of the level table)."""
        if self.policy == "dp":
            return N_LEVELS - 1
        if self.policy == "pyao":
            return N_LEVELS
        return parse_level(self.policy)


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts the plan needs."""

    n_blocks: int
    block_params: int  # psi_total of one block
    block_active: int  # psi_active: weights that take part in matmuls
    static_params: int  # embedding + head (a tied weight once)
    total_params: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelSizes:
        block = block_params(cfg)
        static = cfg.vocab_size * cfg.dim + cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
        return cls(cfg.n_layers, block, block_matmul_params(cfg), static, static + cfg.n_layers * block)


def plan_request_from_config(cfg: SysxConfig, single: SingleSection, model_cfg: ModelConfig) -> PlanRequest:
    """A :class:`PlanRequest` from a job config (``SysxConfig``) and its ``single`` section."""
    t = cfg.train
    gb = single.device_memory_gb
    hb = single.host_memory_gb
    free = ram_available_bytes()
    if hb and hb * GiB > free:  # the job allocates on this host whatever single.hardware assumes
        raise PlanError(
            f"single.host_memory_gb={hb:g} is more than this machine's {gib(free)} of free host memory; "
            f"set single.host_memory_gb <= {free / GiB:.0f} or 0 (all available)"
        )
    return PlanRequest(
        model=model_cfg,
        seq_len=t.seq_len,
        global_batch=t.micro_batch_size * t.micro_batches,
        precision=cfg.precision,
        device_budget_bytes=int(gb * GiB) if gb else None,
        host_budget_bytes=int(hb * GiB) if hb else None,
        chunk=single.micro_batch_size,
        round_sequences=single.round_sequences,
        window=single.window,
        policy=str(single.policy),
        compress=bool(single.compress),
        keep_graph=bool(single.keep_graph),
        seq_chunk=single.seq_chunk,
        grad_clip=float(cfg.optim.grad_clip),
        optimizer_overlap=_overlap_setting(single.optimizer_overlap, cfg.optim.speculate),
        offload=cfg.optim.offload,
    )


def _overlap_setting(overlap: str, speculate: str) -> str:
    """``single.optimizer_overlap`` with ``optim.speculate=always|never`` spelled as the window's
    ``backward|forward`` (a disagreement is the trainer's error)."""
    return {"always": "backward", "never": "forward"}.get(speculate, overlap) if overlap == "auto" else overlap
