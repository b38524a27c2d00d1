"""What ``profile.*`` asks of a trainer's step loop: NVTX on, the Nsight Systems capture range, and
the recorder's window. A trainer calls :meth:`StepWindow.begin` before a step's work,
:meth:`StepWindow.end` once its op list has run and :meth:`StepWindow.after` when the step is over
on every rank; ``after`` says when the recorded window is complete and must be written."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sysx import device as dev
from sysx.trace import ranges
from sysx.trace.recorder import Recorder

if TYPE_CHECKING:
    from sysx.config.sections import ProfileSection


class StepWindow:
    """The profiling settings of one rank's trainer (see the module doc)."""

    def __init__(
        self,
        profile: ProfileSection,
        device: torch.device | str,
        rank: int,
        *,
        compute: dev.Stream | None = None,
        announce: bool = True,
    ) -> None:
        if profile.nvtx:
            ranges.enable(True)  # SYSX_NVTX=1 turns it on too; false leaves the variable's choice
        self.device = torch.device(device)
        self.nsys = tuple(profile.nsys_steps) if profile.nsys_steps is not None else None
        if self.nsys is not None and not dev.is_cuda(self.device):
            if announce:
                print(
                    f"sysx-train: profile.nsys_steps={list(self.nsys)} only applies on CUDA (torch.cuda.profiler); "
                    f"this run is on {self.device.type}, so there is no capture range",
                    flush=True,
                )
            self.nsys = None
        self.recorder: Recorder | None = None
        if profile.timeline_steps is not None:
            first, last = profile.timeline_steps
            self.recorder = Recorder(rank, self.device, steps=(first, last), compute=compute)

    def begin(self, step: int) -> None:
        """Before step ``step``'s work: open the capture range, start recording."""
        if self.nsys is not None and step == self.nsys[0]:
            torch.cuda.profiler.start()
        if self.recorder is not None and self.recorder.wants(step):
            self.recorder.begin_step(step)

    def end(self) -> None:
        """The step's op list has run (also after a failure): stop recording."""
        if self.recorder is not None:
            self.recorder.end_step()

    def after(self, step: int) -> bool:
        """Step ``step`` is over on every rank: close the capture range; True when it was the
        recorder's last step (the caller writes the window)."""
        if self.nsys is not None and step == self.nsys[1]:
            torch.cuda.profiler.stop()
        return self.recorder is not None and step == self.recorder.last and bool(self.recorder.starts)
