"""What a run records about its own time: NVTX ranges for Nsight Systems (:mod:`~sysx.trace.ranges`)
and the per-rank timeline recorder (:mod:`~sysx.trace.recorder`), whose window of steps becomes a
Chrome trace, the same picture ``sysx plan`` draws beside the plan, and a measured-vs-plan summary
(:mod:`~sysx.trace.report`). ``profiling/README.md`` shows how to use them.

This package's ``__init__`` stays light (the runtime imports it): the writers are imported from
their modules.
"""

from __future__ import annotations

from sysx.trace.ranges import enable, enabled, nvtx_range
from sysx.trace.recorder import COMPUTE, RankPart, Recorder, Span, op_lane

__all__ = ["COMPUTE", "RankPart", "Recorder", "Span", "enable", "enabled", "nvtx_range", "op_lane"]
