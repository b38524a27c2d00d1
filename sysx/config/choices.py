"""Every allowed value of a choice in the job configuration, spelled once.

The config sections check against these tuples, and so do the libraries that take the same
settings as arguments (:class:`sysx.runtime.options.PipelineOptions`, :class:`sysx.optim.CpuAdam`,
``sysx plan``, ``sysx plan-single``, the schedule builders). Plain data, no imports: the config
layer must load without torch so ``sysx-train --help`` stays fast.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION_CHOICES = ("auto", *PRECISIONS)  # the config's precision: auto = bf16 on a GPU, fp32 on CPU
DATA_SOURCES = ("default", "file")
TOKEN_DTYPES = ("uint16", "uint32")
OPTIMIZERS = ("adamw",)
OPTIM_BACKENDS = ("auto", "deepspeed", "torch")  # host CPU Adam: auto = DeepSpeed when it builds, else torch
ROLLBACKS = ("undo", "snapshot")  # undoing an overflowed step: Adam's arithmetic inverse | an exact copy

# Schedules run by the multi-process runtime; gpipe and 1f1b place exactly one (whole) stage per rank.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "mobius", "sysx")
ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
SYSX_CFGS = (0, 1, 2, 3)  # sysx ablation configs of the paper's Table 3

# Activation save levels of the sliding window, by id (sysx.single.act_policy): each keeps more.
SAVE_LEVELS = ("input", "attention", "projections", "matmuls", "everything")
POLICIES = ("dp", "pyao", *SAVE_LEVELS)  # single.policy: AdaWS DP | PyAO's IQR rule | a fixed level
OVERLAPS = ("auto", "backward", "forward")  # single.optimizer_overlap

# single.hardware presets: assumed figures for planning on machines we are not on, practical (not
# peak) rates. PCIe 4.0 x16 ~ 25 GB/s per direction in practice, PCIe 5.0 x16 ~ 50 GB/s (AdaWS §4.1
# measures ~64 on H100 with large pinned copies); matmul at ~60-70% of the dense bf16 peak.
ASSUMED_HARDWARE: dict[str, dict[str, float]] = {
    "rtx4090": dict(memory_gib=24, link_gbps=25, bidir_gbps=22, tflops=110, mem_gbps=900),
    "rtx5090": dict(memory_gib=32, link_gbps=50, bidir_gbps=45, tflops=140, mem_gbps=1500),
    "a100_80g": dict(memory_gib=80, link_gbps=25, bidir_gbps=22, tflops=200, mem_gbps=1600),
    "h100": dict(memory_gib=80, link_gbps=50, bidir_gbps=45, tflops=600, mem_gbps=2800),
}
HARDWARE = ("measure", *ASSUMED_HARDWARE)  # single.hardware: measure this machine, or a preset
