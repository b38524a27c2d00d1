"""The NVMe tier of the optimizer states (``optim.offload=nvme``): the I/O engine, the per-rank
state directory and the disk probe. The tier itself (which states, read-ahead, write-back) builds on these."""

from sysx.optim.nvme.engine import open_engine
from sysx.optim.nvme.files import DiskFull, StateDir, StateDirInfo, scan_state_dirs, sweep_state_dirs
from sysx.optim.nvme.io import ALIGN, IoEngine, IoError, aligned_nbytes
from sysx.optim.nvme.probe import DiskProfile, measure_disk

__all__ = [
    "ALIGN",
    "DiskFull",
    "DiskProfile",
    "IoEngine",
    "IoError",
    "StateDir",
    "StateDirInfo",
    "aligned_nbytes",
    "measure_disk",
    "open_engine",
    "scan_state_dirs",
    "sweep_state_dirs",
]
