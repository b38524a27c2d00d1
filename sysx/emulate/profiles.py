"""The emulated cluster of an ``emulate`` config section, in SI units, from the profile tables of
:mod:`sysx.config.choices` (``ASSUMED_HARDWARE``, ``ASSUMED_CPUS``, ``ASSUMED_NETWORKS``, ``ASSUMED_DISKS``:
the one place their numbers are written)."""

from __future__ import annotations

from dataclasses import dataclass

from sysx.config import EmulateSection
from sysx.config.choices import ASSUMED_CPUS, ASSUMED_DISKS, ASSUMED_HARDWARE, ASSUMED_NETWORKS

GB = 1e9
GIB = float(1 << 30)


@dataclass(frozen=True)
class EmulatedCluster:
    """One GPU, its node and the network between GPUs (bandwidths in bytes/s, latencies in s)."""

    gpu: str
    cpu: str
    net: str
    gpu_flops: float  # sustained matmul FLOP/s of one GPU
    gpu_memory_bytes: float
    h2d_bandwidth: float  # host -> GPU, one direction alone
    d2h_bandwidth: float
    bidir_bandwidth: float  # each direction while both copy at once
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    threads_per_rank: int  # the node's cores shared by its GPUs' ranks
    adam_params_per_thread_s: float  # CPU Adam throughput of one thread
    host_memory_bytes: float = 0.0  # RAM of one node (optimizer state and the shared working copy live there)
    device_mem_bandwidth: float = 0.0  # GPU memory bytes/s (an optimizer step on the GPU is bound by it)
    disk: str = ""  # the node's NVMe profile (emulate.disk)
    disk_read_bandwidth: float = 0.0  # all of the node's drives together, shared by its ranks
    disk_write_bandwidth: float = 0.0

    def describe(self) -> str:
        """One line: ``v100 (65 TFLOP/s, 32 GiB, 12 GB/s h2d) x4 per node, epyc7452 (8 threads/rank ...)``."""
        return (
            f"{self.gpu} ({self.gpu_flops / 1e12:g} TFLOP/s, {self.gpu_memory_bytes / GIB:g} GiB, "
            f"{self.h2d_bandwidth / GB:g}/{self.d2h_bandwidth / GB:g} GB/s h2d/d2h) x{self.gpus_per_node} per node, "
            f"{self.cpu} ({self.threads_per_rank} Adam threads per rank, {self.adam_params_per_thread_s / 1e9:g} "
            f"Gparams/s each), {self.net} ({self.intra_bandwidth / GB:g} GB/s in a node, "
            f"{self.inter_bandwidth / GB:g} GB/s between nodes)"
            + (
                f", {self.disk} ({self.disk_read_bandwidth / GB:g}/{self.disk_write_bandwidth / GB:g} GB/s "
                f"read/write per node), {self.host_memory_bytes / GIB:g} GiB RAM per node"
                if self.disk
                else ""
            )
        )


def cluster(section: EmulateSection) -> EmulatedCluster:
    """The cluster named by ``emulate.gpu``, ``emulate.cpu`` and ``emulate.net`` (a validated section)."""
    g, c, n = ASSUMED_HARDWARE[section.gpu], ASSUMED_CPUS[section.cpu], ASSUMED_NETWORKS[section.net]
    disk = ASSUMED_DISKS[section.disk]
    gpn = int(n["gpus_per_node"])
    return EmulatedCluster(
        gpu=section.gpu,
        cpu=section.cpu,
        net=section.net,
        gpu_flops=g["tflops"] * 1e12,
        gpu_memory_bytes=g["memory_gib"] * GIB,
        h2d_bandwidth=g["link_gbps"] * GB,
        d2h_bandwidth=g["link_gbps"] * GB,
        bidir_bandwidth=g["bidir_gbps"] * GB,
        gpus_per_node=gpn,
        intra_bandwidth=n["intra_gbps"] * GB,
        intra_latency=n["intra_latency_us"] * 1e-6,
        inter_bandwidth=n["inter_gbps"] * GB,
        inter_latency=n["inter_latency_us"] * 1e-6,
        threads_per_rank=max(1, int(c["cores"]) // gpn),
        adam_params_per_thread_s=c["adam_gparams_per_thread"] * GB,
        host_memory_bytes=(section.host_memory_gib or c["host_memory_gib"]) * GIB,
        device_mem_bandwidth=g["mem_gbps"] * GB,
        disk=section.disk,
        disk_read_bandwidth=disk["drives"] * disk["read_gbps"] * GB,
        disk_write_bandwidth=disk["drives"] * disk["write_gbps"] * GB,
    )
