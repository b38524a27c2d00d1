"""``device=emulated``: the real multi-process runtime on CPU, paced to the time a GPU cluster of a
named profile would take for a model preset (DESIGN.md, "Devices without a GPU").

* :mod:`~sysx.emulate.profiles`: the cluster of an ``emulate`` config section;
* :mod:`~sysx.emulate.costs`: its costs, cost table and plan (``sysx plan``'s own functions);
* :mod:`~sysx.emulate.streams`: emulated CUDA streams and events (modelled completion times);
* :mod:`~sysx.emulate.pacer`: the hooks the executor, p2p and optimizer threads are paced by;
* :mod:`~sysx.emulate.report`: real part versus modelled time, lateness, the measurement;
* :mod:`~sysx.emulate.device_model`: what a run's time is planned with and compared against, real
  device or emulated, decided once (the trainer asks it, never the kind).
"""

from sysx.emulate.costs import EmulatedModel, EmulatedPlan, emulated_costs, emulated_model, plan_emulation
from sysx.emulate.pacer import EmulatedPacer, Pacer
from sysx.emulate.profiles import EmulatedCluster, cluster
from sysx.emulate.report import StepStats, describe, merge_report
from sysx.emulate.streams import EmulatedEvent, EmulatedStream, sleep_until

__all__ = [
    "EmulatedCluster",
    "EmulatedEvent",
    "EmulatedModel",
    "EmulatedPacer",
    "EmulatedPlan",
    "EmulatedStream",
    "Pacer",
    "StepStats",
    "cluster",
    "describe",
    "emulated_costs",
    "emulated_model",
    "merge_report",
    "plan_emulation",
    "sleep_until",
]
