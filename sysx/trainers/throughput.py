"""The figures that turn a step's time into TFLOP/s and MFU for the logger (:class:`ComputeRate`):
on a GPU the job's model and batch with the GPU's datasheet peak; on an emulated device the
emulated model and batch (``emulate.model`` at ``emulate.seq_len`` x ``emulate.micro_batch_size``),
whose modelled step times the records carry, with the emulated GPU's peak. None on a CPU, where
TFLOP/s would compare with nothing."""

from __future__ import annotations

import torch

from sysx import device as dev
from sysx.config import SysxConfig
from sysx.config.choices import ASSUMED_HARDWARE, EMULATED_DEVICE
from sysx.machine.peak import peak_flops_per_s
from sysx.metrics import ComputeRate
from sysx.model import ModelConfig
from sysx.model.flops import flops_per_token


def compute_rate(cfg: SysxConfig, model: ModelConfig, device: torch.device, *, devices: int) -> ComputeRate | None:
    """TFLOP/s and MFU figures of a job of ``cfg`` training ``model`` on ``devices`` devices (all
    ranks of all replicas), or None on a CPU."""
    if cfg.device == EMULATED_DEVICE:
        from sysx.emulate.costs import emulated_model

        emulated = emulated_model(cfg)
        sequences = cfg.parallel.count * cfg.train.micro_batches * emulated.micro_batch_size
        tokens = sequences * emulated.seq_len
        return ComputeRate(
            flops_per_step=flops_per_token(emulated.config, emulated.seq_len) * tokens,
            devices=devices,
            peak_flops_per_s=ASSUMED_HARDWARE[cfg.emulate.gpu]["peak_tflops"] * 1e12,
        )
    if not dev.is_cuda(device):
        return None
    return ComputeRate(
        flops_per_step=flops_per_token(model, cfg.train.seq_len) * cfg.tokens_per_step,
        devices=devices,
        peak_flops_per_s=peak_flops_per_s(torch.cuda.get_device_name(device)),
    )
