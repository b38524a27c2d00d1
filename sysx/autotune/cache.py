"""Autotune profiles cached per machine and model shape under ``<sysx cache>/autotune/``.

The file name holds a hash of :func:`~sysx.machine.hardware_cache.machine_key`, one of
:func:`~sysx.autotune.profile.shape_key` and the intra-op threads the layers were timed with (a
rank's cores, :func:`sysx.optim.cores.rank_cores`): a new machine, a changed shape or another number
of ranks per node gets a fresh profile, the same job reuses it. Before, the layers were timed with
whatever the tuning process had (one thread under torchrun or mpiexec with several ranks, every
core alone) and the file answered for any job of the shape: a 16-core node's 4 ranks, which
compute with 4 threads each, were priced at one. A cached profile that lacks a micro-batch size
now asked for is measured again. The p2p figures of the last tuned job's ranks are kept in the same
file; the hardware figures come from :mod:`sysx.machine.hardware_cache`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from sysx import device as dev
from sysx.autotune import profile as prof
from sysx.autotune.p2p import P2PFigures
from sysx.cachedir import cache_root
from sysx.machine.hardware_cache import digest, load_or_measure_hardware, machine_key, write_atomic
from sysx.model import ModelConfig
from sysx.optim.cores import intra_op_threads

log = logging.getLogger(__name__)

# raised when what is measured or how changes, so profiles of an older profiler are measured again
# 10: the backward's bytes at every micro-batch's token count, one Block against four; 9: a CPU
# layer's passes the mean of windows in rounds (was the fastest of 3); 8: the Adam and job rates
# timed with the caches cold, the backward's bytes at the fewest and the most tokens; 7: the
# optimizer job's rate; 6: timed with the ranks' threads, which the file name holds; 5: a CPU
# profile's backward_bytes; 4: op_host_s, process_bytes, tiny-message p2p latency (issue 27)
PROFILE_VERSION = 10


def profile_path(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: torch.device, threads: int | None = None
) -> Path:
    """Where the profile of this machine and model shape, timed with ``threads`` intra-op threads
    (None: this thread's now), is kept."""
    machine = digest(machine_key(device))
    shape = digest(prof.shape_key(cfg, seq_len, dtype))
    t = torch.get_num_threads() if threads is None else threads
    return cache_root() / "autotune" / f"profile-v{PROFILE_VERSION}-{machine}-{shape}-t{t}.json"


def _save(path: Path, found: prof.MachineProfile) -> None:
    write_atomic(path, found.to_json())


def cached_profile(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: torch.device, threads: int | None = None
) -> prof.MachineProfile | None:
    """The cached profile of this machine and shape timed with ``threads`` (as for :func:`profile_path`),
    or None (none, unreadable, or another shape)."""
    path = profile_path(cfg, seq_len, dtype, device, threads)
    if not path.exists():
        return None
    try:
        cached = prof.MachineProfile.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError) as err:  # an older or damaged file: measure again
        log.warning("ignoring the unreadable profile %s (%s)", path, err)
        return None
    return cached if cached.shape == prof.shape_key(cfg, seq_len, dtype) else None


def load_or_measure(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch_sizes: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    refresh: bool = False,
    p2p: P2PFigures | None = None,
    threads: int | None = None,
    **measure: Any,
) -> tuple[prof.MachineProfile, bool]:
    """The cached profile when it covers ``micro_batch_sizes``, else a new measurement (saved).

    Returns ``(profile, reused)``. ``refresh`` measures even when a cached profile exists. ``p2p``:
    figures just measured between the job's ranks; they replace the profile's and are saved with it.
    ``threads``: the intra-op threads a rank computes with, which the layers are timed with (None:
    this thread's now).
    """
    device = dev.default_device() if device is None else torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    path = profile_path(cfg, seq_len, dtype, device, threads)
    want = {m * seq_len for m in micro_batch_sizes}
    cached = None if refresh else cached_profile(cfg, seq_len, dtype, device, threads)
    if cached is not None and want <= cached.measured_tokens():
        if p2p is not None:
            cached = dataclasses.replace(cached, p2p=p2p)
            _save(path, cached)
        return cached, True
    hardware, _ = load_or_measure_hardware(device, dtype, refresh=refresh)
    with intra_op_threads(threads):
        found = prof.measure_profile(
            cfg, seq_len, micro_batch_sizes, dtype=dtype, device=device, hardware=hardware, **measure
        )
    found.p2p = p2p if p2p is not None else (cached.p2p if cached is not None else None)
    _save(path, found)
    return found, False
