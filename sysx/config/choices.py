"""Every allowed value of a choice in the job configuration, spelled once.

The config sections check against these tuples, and so do the libraries that take the same
settings as arguments (:class:`sysx.runtime.options.PipelineOptions`, :class:`sysx.optim.CpuAdam`,
``sysx plan``, ``sysx plan-single``, the schedule builders). Plain data, no imports: the config
layer must load without torch so ``sysx-train --help`` stays fast.
"""

from __future__ import annotations

from typing import Literal

PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION_CHOICES = ("auto", *PRECISIONS)  # the config's precision: auto = bf16 on a GPU, fp32 on CPU
DATA_SOURCES = ("default", "file")
TOKEN_DTYPES = ("uint16", "uint32")
OPTIMIZERS = ("adamw",)
OPTIM_BACKENDS = ("auto", "deepspeed", "torch")  # host CPU Adam: auto = DeepSpeed when it builds, else torch
# undoing an overflowed step: Adam's arithmetic inverse | an exact copy | a second (p, m, v) set, switched
ROLLBACK_MODES = ("undo", "snapshot", "exact")
ROLLBACKS = (*ROLLBACK_MODES, "auto")  # auto: exact when the host memory budget allows it, else undo
SPECULATE_MODES = ("auto", "always", "never")  # optim.speculate (sysx.optim.speculate)
SPECULATE_AFTER = 4  # optim.speculate_after's default: clean steps after a vetoed one (sysx.optim.speculate)
PLACEMENTS = ("auto", "cpu", "split")  # optim.placement: where Adam updates run (sysx.optim.placement)
OFFLOADS = ("host", "nvme")  # optim.offload: where the fp32 optimizer state lives between steps
NVME_ENGINES = ("auto", "aio", "threads")  # optim.nvme_engine: the state files' I/O engine
BIND_CORES = ("auto", "true", "false")  # parallel.bind_cores (sysx.optim.cores.bind_choice), any case
# log.backends (sysx.tracking): name -> (the module it imports, the pip extra that installs it); jsonl needs none
LOG_BACKENDS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}
WANDB_MODES = ("auto", "offline", "online")  # log.wandb_mode: auto = WANDB_MODE, else online with an API key

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
# peak_tflops: the datasheet's dense 16-bit tensor peak (fp32 accumulate), the MFU denominator of an emulated GPU.
ASSUMED_HARDWARE: dict[str, dict[str, float]] = {
    "rtx4090": dict(memory_gib=24, link_gbps=25, bidir_gbps=22, tflops=110, mem_gbps=900, peak_tflops=165),
    "rtx5090": dict(memory_gib=32, link_gbps=50, bidir_gbps=45, tflops=140, mem_gbps=1500, peak_tflops=209.5),
    "a100_80g": dict(memory_gib=80, link_gbps=25, bidir_gbps=22, tflops=200, mem_gbps=1600, peak_tflops=312),
    "h100": dict(memory_gib=80, link_gbps=50, bidir_gbps=45, tflops=600, mem_gbps=2800, peak_tflops=989),
    # SysX paper's cluster (Table 1): V100 32 GB on PCIe Gen3 x16 (~12 GB/s each way in practice);
    # fp16 tensor cores, ~58% of the PCIe card's 112 TFLOP/s peak (no fused attention on Volta)
    "v100": dict(memory_gib=32, link_gbps=12, bidir_gbps=10, tflops=65, mem_gbps=800, peak_tflops=112),
}
# single.hardware: this machine (measured once and cached per machine; remeasure: measure it again), or a preset
HARDWARE = ("measure", "remeasure", *ASSUMED_HARDWARE)

# device=emulated (sysx.emulate): every rank acts as a GPU of ASSUMED_HARDWARE[emulate.gpu] in a node
# of ASSUMED_CPUS[emulate.cpu], linked by ASSUMED_NETWORKS[emulate.net]. CPU Adam is memory-bound:
# ~30 bytes moved per parameter, so a 32-core EPYC with 8 DDR4-2666 channels (~110 GB/s in practice)
# steps ~3.5 Gparams/s, ~0.1 per core. Each rank gets cores // gpus_per_node threads.
EMULATED_DEVICE = "emulated"
ASSUMED_CPUS: dict[str, dict[str, float]] = {
    # host_memory_gib: the node's RAM (the SysX paper's nodes have 512 GB; the 9654 node is assumed
    # with one 64 GiB DIMM per channel)
    "epyc7452": dict(
        cores=32, adam_gparams_per_thread=0.1, host_memory_gib=512
    ),  # the SysX paper's nodes (AMD EPYC 7452)
    "epyc9654": dict(cores=96, adam_gparams_per_thread=0.15, host_memory_gib=768),  # 12 DDR5-4800 channels
}
# The NVMe drives of a node (emulate.disk) holding the optimizer states of optim.offload=nvme
# (sysx.optim.nvme): GB/s of one drive, sequential reads and writes of large aligned files at a
# deep queue (PCIe Gen3 x4 drives such as the Samsung 970 Pro: ~3.5 read, ~2.7-3.0 write; Gen4 x4:
# ~7 and ~5.5). The node's ranks share its drives.
ASSUMED_DISKS: dict[str, dict[str, float]] = {
    "nvme3x4": dict(drives=4, read_gbps=3.5, write_gbps=3.0),
    "nvme3x1": dict(drives=1, read_gbps=3.5, write_gbps=3.0),
    "nvme4x4": dict(drives=4, read_gbps=7.0, write_gbps=5.5),
}
# GPU<->GPU messages inside a node and between nodes (GB/s one way, latency in microseconds).
ASSUMED_NETWORKS: dict[str, dict[str, float]] = {
    # the SysX paper: 4 V100 per node on PCIe Gen3 (peer copies through the root complex), one
    # ConnectX-6 InfiniBand HDR NIC (200 Gb/s) per node, reached from a GPU over PCIe Gen3
    "pcie3_ib_hdr": dict(gpus_per_node=4, intra_gbps=10, intra_latency_us=10, inter_gbps=11, inter_latency_us=12),
    "pcie4_ib_hdr": dict(gpus_per_node=4, intra_gbps=20, intra_latency_us=10, inter_gbps=22, inter_latency_us=10),
    "nvlink_ib_ndr": dict(gpus_per_node=8, intra_gbps=350, intra_latency_us=5, inter_gbps=45, inter_latency_us=8),
}


def bind_setting(value: object) -> bool | Literal["auto"]:
    """``parallel.bind_cores`` as ``"auto"``, True or False (Hydra's and YAML's ``true`` reach the
    string key as ``"True"``)."""
    text = str(value).lower()
    return "auto" if text == "auto" else text == "true"
