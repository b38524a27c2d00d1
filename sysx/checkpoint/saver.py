"""Saving without stalling training: snapshot the state in host memory, write it on a thread.

The training state already lives in host memory, so a save costs the GPUs nothing but the time it
takes to copy the owned layers into a snapshot (a memory copy). A background thread then encodes
and writes the layer files, and rank 0 commits (:mod:`sysx.checkpoint.store`). When the snapshot
would not fit in the host memory that is available, the layers are written synchronously, one at a
time (the extra memory is one layer), with a progress line. State that lives in files (the NVMe
tier: :class:`sysx.checkpoint.streamed.StreamedLayer`) is written synchronously too, streamed in
bounded pieces (the extra memory is the tier's staging buffer). Either way the *stall* — how long the
training loop waited for the save — is measured and returned, so it can be logged per save.

One save is in flight at a time: a new save, :meth:`CheckpointSaver.wait` and
:meth:`CheckpointSaver.close` wait for the previous one and re-raise its error.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sysx.checkpoint.layer_state import LayerState, encode_layer
from sysx.checkpoint.store import TRAINER_STATE, CheckpointDir, PendingCheckpoint, layer_filename
from sysx.checkpoint.streamed import StreamedLayer, layer_chunks
from sysx.memory.budget import ram_available_bytes

# Keep this much host memory free beyond a snapshot before choosing the background path.
HOST_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class SaveReport:
    """What one save cost the training loop."""

    step: int
    mode: str  # "background" (snapshot, then a thread writes) or "sync" (written before training goes on)
    stall_s: float  # time the training loop waited (snapshot copy, or the whole write)
    nbytes: int  # bytes of layer state this rank saved


# returns views of the live state, which the saver copies or writes; or, for state in files (the NVMe
# tier), streams of it, which the saver writes piece by piece before training goes on
LayerSource = Callable[[], LayerState | StreamedLayer]


class CheckpointSaver:
    """One rank's saver (every rank of a job has one, with the same ``tag`` prefix)."""

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int,
        world: int,
        keep: int,
        tag: str,
        available_bytes: Callable[[], int] | None = None,
        commit_timeout_s: float = 600.0,
        peer_check: Callable[[], None] | None = None,
    ) -> None:
        self.dir = CheckpointDir(root)
        self.rank, self.world, self.keep, self.tag = rank, world, keep, tag
        self.commit_timeout_s = commit_timeout_s
        self.peer_check = peer_check  # raises when a rank failed or died (its layers will never come)
        self._available = available_bytes or ram_available_bytes
        self._pool: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sysx-ckpt")
        self._inflight: cf.Future[Path | None] | None = None
        self._saves = 0
        self._snapshots: dict[int, LayerState] = {}  # reused from save to save (see LayerState.snapshot)
        self.last_path: Path | None = None

    def save(
        self,
        step: int,
        layers: Mapping[int, LayerSource],
        *,
        manifest: Mapping[str, Any] | None = None,
        trainer_state: Mapping[str, Any] | None = None,
        background: bool = True,
    ) -> SaveReport:
        """Save this rank's ``layers`` (index -> source) for ``step``; rank 0 also ``trainer_state``
        and the ``manifest`` fields (model shape, config) and commits."""
        t0 = time.perf_counter()
        self.wait()
        self._saves += 1
        pending = self.dir.begin(step, f"{self.tag}-{self._saves}")
        states = [layers[i]() for i in sorted(layers)]
        nbytes = sum(s.nbytes for s in states)
        extra = {"manifest": dict(manifest or {}), "trainer": dict(trainer_state or {})}
        in_memory = [s for s in states if isinstance(s, LayerState)]
        if background and len(in_memory) == len(states) and nbytes + HOST_MARGIN_BYTES <= self._available():
            snapshot = [s.snapshot(into=self._snapshots.get(s.layer)) for s in in_memory]
            self._snapshots = {s.layer: s for s in snapshot}
            self._inflight = self._executor().submit(self._write, pending, snapshot, extra, False)
            return SaveReport(step, "background", time.perf_counter() - t0, nbytes)
        if background and self.rank == 0 and len(in_memory) == len(states):
            print(
                f"checkpoint step {step}: {nbytes / 2**30:.2f} GiB do not fit beside training in the host memory "
                f"available ({self._available() / 2**30:.2f} GiB); writing them before training goes on",
                file=sys.stderr,
                flush=True,
            )
        self.last_path = self._write(pending, states, extra, show_progress=True)
        return SaveReport(step, "sync", time.perf_counter() - t0, nbytes)

    def wait(self) -> Path | None:
        """Wait for the save in flight (re-raising its error); returns the committed path on rank 0."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self.last_path = inflight.result()
        return self.last_path

    def close(self, *, failing: bool = False) -> None:
        """Finish the save in flight and stop the thread (idempotent). ``failing``: the job is ending on
        an error already, which a save that failed with it (a rank it waited for died) would only hide."""
        try:
            self.wait()
        except Exception:
            if not failing:
                raise
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)
            self._snapshots.clear()

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            raise RuntimeError("CheckpointSaver used after close()")
        return self._pool

    def _write(
        self,
        pending: PendingCheckpoint,
        states: Sequence[LayerState | StreamedLayer],
        extra: dict[str, dict[str, Any]],
        show_progress: bool,
    ) -> Path | None:
        # a bar on rank 0's terminal, only for writes long enough to watch (tqdm's delay)
        bar = tqdm(
            total=len(states),
            desc=f"checkpoint step {pending.step}",
            unit="layer",
            delay=1.0,
            file=sys.stderr,
            disable=not (show_progress and self.rank == 0 and sys.stderr.isatty()),
        )
        with bar:
            for state in states:
                name = layer_filename(state.layer)
                if isinstance(state, StreamedLayer):
                    pending.write_stream(name, layer_chunks(state), layer=state.layer, rank=self.rank)
                else:
                    pending.write_file(name, encode_layer(state), layer=state.layer, rank=self.rank)
                bar.update(1)
        if self.rank == 0:
            pending.write_file(TRAINER_STATE, json.dumps(extra["trainer"], indent=1, sort_keys=True).encode())
        pending.finish_rank(self.rank)
        if self.rank != 0:
            return None
        return pending.commit(
            world=self.world,
            manifest=extra["manifest"],
            keep=self.keep,
            timeout_s=self.commit_timeout_s,
            check=self.peer_check,
        )
