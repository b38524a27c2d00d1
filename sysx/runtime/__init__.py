"""The multi-process runtime: one executor for every schedule, one process per device.

* :mod:`sysx.runtime.options` - :class:`PipelineOptions` and the validated schedule of a run;
* :mod:`sysx.runtime.stage_params` - who owns which sub-stage's parameters in shared memory;
* :mod:`sysx.runtime.buffers` - device parameter slots and gradient buffers, H2D/D2H streams;
* :mod:`sysx.runtime.p2p` - checked, time-bounded activations / gradients / checkpoints;
* :mod:`sysx.runtime.optimizer` - OFFLOAD_GRADS, OPTIM_STEP and VALIDATE on the host;
* :mod:`sysx.runtime.executor` - the interpreter (dispatch table ``OpKind -> handler``).

The trainer that drives them is :class:`sysx.trainers.pipeline.PipelineTrainer`.
"""

from sysx.runtime.executor import ExecutionError, Executor, StepContext
from sysx.runtime.options import PipelineOptions, RuntimeConfigError, make_schedule, options_from_config
from sysx.runtime.p2p import P2P, TransferMismatch, TransferSpec

__all__ = [
    "P2P",
    "ExecutionError",
    "Executor",
    "PipelineOptions",
    "RuntimeConfigError",
    "StepContext",
    "TransferMismatch",
    "TransferSpec",
    "make_schedule",
    "options_from_config",
]
