"""Per-step metrics: :class:`StepResult` (what one optimizer step did), and :class:`RunLogger`, which
turns each into one record and hands it to the metrics backends (:mod:`sysx.tracking`:
``run_dir/metrics.jsonl`` by default, TensorBoard, W&B), prints log lines or a progress bar, and the
run's summary.

The logger runs on rank 0 (other ranks get a silent one) and every backend flushes each step, so a
crash loses nothing already logged. ``step`` is the 0-based index that also selects the step's data
and learning rate; non-finite floats (the gradient norm of a skipped fp16 step) are written as ``null``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from sysx import device as dev
from sysx.memory.budget import fmt_bytes
from sysx.tracking import METRICS_FILE, JsonlBackend, MetricsBackend

SUMMARY_FILE = "summary.json"
__all__ = ["METRICS_FILE", "SUMMARY_FILE", "ComputeRate", "RunLogger", "RunSummary", "StepResult", "fmt_count"]


@dataclass
class StepResult:
    """What one optimizer step did: the record every trainer returns and the logger writes."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    scale: float
    tokens: int
    step_time_s: float
    val_loss: float | None = None
    checkpoint_stall_s: float | None = None  # set on steps after which a checkpoint was saved
    # the host optimizer (window and pipelines; sysx.optim.speculate): did the step run before its
    # validation, how many stage steps were rolled back / re-stepped with the clip coefficient, and
    # the optimizer time no compute hid (after the last backward; the window's waits before loads too)
    speculated: bool | None = None
    rolled_back: int | None = None
    restepped: int | None = None
    opt_exposed_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of this step."""
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(frozen=True)
class ComputeRate:
    """What turns a step's time into TFLOP/s and MFU (PaLM's convention, :mod:`sysx.model.flops`:
    recomputation is not counted). Given on a GPU and an emulated one only."""

    flops_per_step: float  # training FLOPs of one optimizer step, all devices together
    devices: int  # devices the step runs on (the TFLOP/s are per device)
    peak_flops_per_s: float | None = None  # one device's dense 16-bit peak, when known (MFU's denominator)

    def tflops(self, step_time_s: float) -> float:
        """Achieved TFLOP/s of one device in a step of ``step_time_s``."""
        return self.flops_per_step / step_time_s / self.devices / 1e12 if step_time_s > 0 else 0.0


@dataclass
class RunSummary:
    """The whole run in a few numbers (printed at the end and written to ``summary.json``)."""

    steps: int
    first_loss: float
    last_loss: float
    min_loss: float
    last_val_loss: float | None
    skipped_steps: int
    tokens: int
    mean_tokens_per_s: float
    train_time_s: float  # the steps' time, in ``clock`` seconds
    total_time_s: float  # start to end of the run, in ``clock`` seconds
    peak_device_mem_bytes: int
    peak_host_rss_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)
    stopped: str | None = None  # the signal that stopped the run early (SIGINT, SIGTERM)
    clock: str = "wall"  # "modelled" on an emulated device: its step times are the modelled ones
    wall_time_s: float | None = None  # start to end in wall seconds, when the clock is modelled


def fmt_count(n: float) -> str:
    """``1234567 -> '1.23M'``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.4g}"


def _json_float(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class RunLogger:
    """Feeds each step's record to the metrics backends, prints log lines / a progress bar, and the
    final summary (rank 0 only). It closes the backends on every way out: :meth:`close`, or leaving
    its ``with`` block (then with ``failed=True`` when an exception, a stop included, goes through)."""

    def __init__(
        self,
        run_dir: Path | None,
        *,
        total_steps: int,
        every: int,
        progress: bool,
        device: torch.device,
        enabled: bool = True,
        stream: IO[str] | None = None,
        first_step: int = 0,
        time_scale: float | None = None,
        backends: Sequence[MetricsBackend] | None = None,
        compute: ComputeRate | None = None,
    ) -> None:
        """``time_scale``: the step times are modelled seconds of an emulated device running this many
        times slower than modelled (``emulate.time_scale``); the run's total is then reported in
        modelled seconds too, so the closing line never adds up seconds of two kinds.
        ``backends``: open backends the logger writes and closes (:func:`sysx.tracking.open_backends`);
        None: ``run_dir/metrics.jsonl`` alone (nothing without a ``run_dir``). ``compute``: adds
        TFLOP/s and MFU to each record."""
        self.enabled = enabled
        self.time_scale = time_scale
        self.total_steps = total_steps
        self.every = max(1, every)
        self.device = torch.device(device)
        self.stream = stream if stream is not None else sys.stdout
        self.results: list[StepResult] = []
        self.notes: dict[str, Any] = {}
        self.sections: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._bar: Any = None
        self.compute = compute
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.backends: list[MetricsBackend] = list(backends) if backends is not None else []
        self.places: list[str] = []
        if not enabled:
            self._close_backends(failed=False)  # another rank's logger: it owns none
            return
        if backends is None and self.run_dir is not None:
            self.backends = [JsonlBackend(self.run_dir / METRICS_FILE, first_step)]
        self.places = [backend.where for backend in self.backends]  # for the closing line
        if progress and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=first_step, desc="train", unit="step", file=self.stream, dynamic_ncols=True
            )

    # -- per step
    def record(self, result: StepResult) -> dict[str, Any]:
        """The JSON object written for ``result`` (adds throughput, memory peaks and elapsed time)."""
        rec: dict[str, Any] = asdict(result)
        rec["grad_norm"] = _json_float(result.grad_norm)
        rec["loss"] = _json_float(result.loss)
        rec["tokens_per_s"] = result.tokens_per_s
        rec["peak_device_mem_bytes"] = dev.max_memory_allocated(self.device)
        rec["peak_host_rss_bytes"] = dev.host_peak_rss_bytes()
        rec["elapsed_s"] = time.perf_counter() - self._start
        if self.compute is not None:
            rec["tflops"] = self.compute.tflops(result.step_time_s)
            if self.compute.peak_flops_per_s:
                rec["mfu"] = rec["tflops"] * 1e12 / self.compute.peak_flops_per_s
        for optional in ("val_loss", "checkpoint_stall_s", "speculated", "rolled_back", "restepped", "opt_exposed_s"):
            if rec[optional] is None:
                del rec[optional]
        return rec

    def log(self, result: StepResult) -> None:
        """Log one step: its record to every backend, the progress bar, and a console line when due."""
        self.results.append(result)
        if not self.enabled:
            return
        rec = self.record(result)
        for backend in self.backends:
            backend.write(rec)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"loss {result.loss:.4f} {fmt_count(result.tokens_per_s)} tok/s", refresh=False)
        last = result.step == self.total_steps - 1
        if (
            result.step % self.every == 0
            or last
            or result.val_loss is not None
            or result.checkpoint_stall_s is not None
        ):
            self._print(self.format_line(rec))

    def format_line(self, rec: dict[str, Any]) -> str:
        """One console line for a metrics record."""
        loss = rec["loss"]
        parts = [
            f"step {rec['step']:>{len(str(self.total_steps))}}/{self.total_steps}",
            f"loss {loss:.4f}" if loss is not None else "loss nan",
        ]
        if rec.get("val_loss") is not None:
            parts.append(f"val {rec['val_loss']:.4f}")
        parts += [
            f"lr {rec['lr']:.2e}",
            f"{fmt_count(rec['tokens_per_s'])} tok/s",
            f"{rec['step_time_s'] * 1000:.0f} ms/step",
        ]
        if "tflops" in rec:
            mfu = f" (MFU {rec['mfu']:.1%})" if "mfu" in rec else ""
            parts.append(f"{rec['tflops']:.3g} TFLOP/s{mfu}")
        if dev.is_cuda(self.device):
            parts.append(f"dev mem {fmt_bytes(rec['peak_device_mem_bytes'])}")
        parts.append(f"host rss {fmt_bytes(rec['peak_host_rss_bytes'])}")
        if rec.get("checkpoint_stall_s") is not None:
            parts.append(f"checkpoint saved (stalled {rec['checkpoint_stall_s'] * 1000:.0f} ms)")
        if rec["skipped"]:
            parts.append("SKIPPED (overflow)")
        if rec["scale"] != 1.0:
            parts.append(f"scale {rec['scale']:g}")
        return " | ".join(parts)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def note(self, key: str, value: Any) -> None:
        """Add ``key`` to the run's summary (``summary.json``'s ``extra``)."""
        self.notes[key] = value

    def section(self, key: str, value: Any) -> None:
        """Add a top-level ``key`` to ``summary.json`` (e.g. a recorded timeline's ``measured`` and ``plan``)."""
        self.sections[key] = value

    def info(self, text: str) -> None:
        """Print a message (rank 0 only), above the progress bar if there is one."""
        if self.enabled:
            self._print(text)

    # -- end of run
    def summary(self) -> RunSummary:
        """Numbers of the run so far."""
        rs = self.results
        train_time = sum(r.step_time_s for r in rs)
        wall = time.perf_counter() - self._start
        tokens = sum(r.tokens for r in rs)
        vals = [r.val_loss for r in rs if r.val_loss is not None]
        losses = [r.loss for r in rs if math.isfinite(r.loss)]
        return RunSummary(
            steps=len(rs),
            first_loss=rs[0].loss if rs else math.nan,
            last_loss=rs[-1].loss if rs else math.nan,
            min_loss=min(losses) if losses else math.nan,
            last_val_loss=vals[-1] if vals else None,
            skipped_steps=sum(r.skipped for r in rs),
            tokens=tokens,
            mean_tokens_per_s=tokens / train_time if train_time > 0 else 0.0,
            train_time_s=train_time,
            total_time_s=wall if self.time_scale is None else wall / self.time_scale,
            peak_device_mem_bytes=dev.max_memory_allocated(self.device),
            peak_host_rss_bytes=dev.host_peak_rss_bytes(),
            extra=dict(self.notes),
            clock="wall" if self.time_scale is None else "modelled",
            wall_time_s=None if self.time_scale is None else wall,
        )

    def close(self, *, stopped: str | None = None) -> RunSummary:
        """Close the bar and the metrics file, print the summary line, write ``summary.json``.
        A run ``stopped`` by a signal records it there and prints nothing (the job prints one line)."""
        s = self.summary()
        s.stopped = stopped
        if not self.enabled:
            return s
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._close_backends(failed=stopped is not None)
        if self.run_dir is not None:
            data = {k: _json_float(v) if isinstance(v, float) else v for k, v in asdict(s).items()}
            data.update(self.sections)
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(data, indent=1) + "\n")
        if stopped is None:
            self._print(self.format_summary(s))
        return s

    def format_summary(self, s: RunSummary) -> str:
        """The closing line: first and last loss, mean throughput, total time."""
        val = f" | val {s.last_val_loss:.4f}" if s.last_val_loss is not None else ""
        skipped = f" | {s.skipped_steps} skipped" if s.skipped_steps else ""
        mem = f" | peak dev mem {fmt_bytes(s.peak_device_mem_bytes)}" if dev.is_cuda(self.device) else ""
        where = "".join(f" | {place}" for place in self.places)
        clock = ""
        if s.clock != "wall":
            clock = f" {s.clock} (emulated: wall / emulate.time_scale {self.time_scale:g}; wall {s.wall_time_s:.1f} s)"
        return (
            f"done: {s.steps} steps | loss {s.first_loss:.4f} -> {s.last_loss:.4f}{val} | "
            f"mean {fmt_count(s.mean_tokens_per_s)} tok/s | train {s.train_time_s:.1f} s, total {s.total_time_s:.1f} s{clock}"
            f"{skipped}{mem} | peak host rss {fmt_bytes(s.peak_host_rss_bytes)}{where}"
        )

    def __enter__(self) -> RunLogger:
        return self

    def _close_backends(self, *, failed: bool) -> None:
        """Close every backend, each even if another fails (the first error goes up)."""
        backends, self.backends = self.backends, []
        errors = []
        for backend in backends:
            try:
                backend.close(failed=failed)
            except Exception as err:  # the others must close too
                errors.append(err)
        if errors:
            raise errors[0]

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._close_backends(failed=exc_type is not None)
