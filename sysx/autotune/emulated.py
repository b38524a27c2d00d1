"""The emulated device answers the profiler with its own profile: nothing on this CPU is measured.

``device=emulated`` paces every op to the :class:`~sysx.schedule.costs.Costs` of
:func:`sysx.emulate.emulated_costs` (``emulate.model`` at ``emulate.seq_len`` on the cluster of
``emulate.gpu/cpu/net``). The :class:`MachineProfile` here is read off those same costs: layer
times per micro-batch size, backward with recompute, copy rates, CPU Adam throughput, p2p figures
in and between nodes; the budgets are the emulated GPU's memory and the emulated node's RAM (half
of it for ``/dev/shm``, Linux's default tmpfs size). So :func:`sysx.autotune.costs.profiled_costs`
of this profile gives back the costs the emulated run plays (one source of truth).
"""

from __future__ import annotations

import dataclasses

from sysx.autotune.p2p import P2PFigures
from sysx.autotune.profile import LayerTiming, MachineProfile, shape_key
from sysx.config import SysxConfig
from sysx.emulate import cluster, emulated_costs, emulated_model
from sysx.emulate.costs import op_host_seconds
from sysx.machine.hardware import HardwareProfile

_KINDS = {"embedding": 0, "block": 1, "head": -1}  # a flat layer of each kind


def emulated_profile(cfg: SysxConfig, micro_batch_sizes: list[int]) -> MachineProfile:
    """The profile of ``cfg.emulate``'s cluster and model at each micro-batch size (see the module doc)."""
    hw, model = cluster(cfg.emulate), emulated_model(cfg)
    layers: dict[str, list[LayerTiming]] = {k: [] for k in _KINDS}
    for mbs in sorted(set(micro_batch_sizes)):
        # workers do not change layer times; one synchronous worker keeps the call simple
        costs = emulated_costs(
            hw,
            dataclasses.replace(model, micro_batch_size=mbs),
            precision=cfg.precision,
            workers=1,
            async_optimizer=False,
        )
        backward = 1.0 + costs.bwd_ratio if costs.recompute else costs.bwd_ratio
        for kind, index in _KINDS.items():
            fwd = costs.layer_fwd_time[index]
            layers[kind].append(LayerTiming(tokens=mbs * model.seq_len, fwd_s=fwd, bwd_s=backward * fwd))
    host = int(hw.host_memory_bytes)
    hardware = HardwareProfile(
        name=f"emulated {hw.gpu}",
        kind="emulated",
        h2d_bytes_per_s=hw.h2d_bandwidth,
        d2h_bytes_per_s=hw.d2h_bandwidth,
        bidir_bytes_per_s=hw.bidir_bandwidth,
        matmul_flops_per_s=hw.gpu_flops,
        device_mem_bytes_per_s=0.0,
        device_free_bytes=int(hw.gpu_memory_bytes),
        device_total_bytes=int(hw.gpu_memory_bytes),
        host_free_bytes=host,
        host_total_bytes=host,
        measured=False,
        op_host_s=op_host_seconds(cfg),  # the real host work, in the emulated cluster's seconds
    )
    p2p = P2PFigures(
        ranks=0,
        ranks_per_node=hw.gpus_per_node,
        intra_bandwidth=hw.intra_bandwidth,
        intra_latency=hw.intra_latency,
        inter_bandwidth=hw.inter_bandwidth,
        inter_latency=hw.inter_latency,
    )
    dtype = "float32" if cfg.precision == "fp32" else "bfloat16"
    shape = shape_key(model.config, model.seq_len, dtype)  # type: ignore[arg-type]
    return MachineProfile(
        machine={"emulated": hw.describe()},
        shape=shape,
        hardware=hardware,
        layers=layers,
        adam_params_per_s=hw.adam_params_per_thread_s,
        cpu_threads=hw.threads_per_rank * hw.gpus_per_node,
        host_available=host,
        shm_free=host // 2,
        shm_total=host // 2,
        p2p=p2p,
        notes=["emulated: the costs the emulated device plays, not a measurement"],
    )
