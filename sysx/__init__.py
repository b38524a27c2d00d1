"""sysx: train LLMs larger than your GPUs with host-memory offloading.

Multi-GPU: the SysX hybrid GPU-CPU pipeline. Single GPU: the AdaWS sliding window.
Submodules are imported on demand; importing ``sysx`` itself is cheap.
"""

__version__ = "0.1.0"
