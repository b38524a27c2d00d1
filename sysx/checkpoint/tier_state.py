"""Between the NVMe tier's flat state files and layer-keyed checkpoint files, in bounded memory.

A host optimizer's state is three flat fp32 buffers (master, ``exp_avg``, ``exp_avg_sq``) laid out
by a :class:`sysx.model.FlatLayout`; with the NVMe tier some of them are regions of state files
instead (:class:`FileRegion`). :func:`tier_layer_sources` turns them into per-layer
:class:`StreamedLayer` sources for :class:`sysx.checkpoint.CheckpointSaver`: each tensor's bytes
come out of its state file through a :class:`SpanIO` (the tier's one staging buffer), so a save
never holds a layer, let alone a stage, in RAM. :func:`restore_flat` does the reverse: each target
is filled in order, every piece copied straight from where the tensor lies in its checkpoint file.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sysx.checkpoint.flat_state import entries_by_layer
from sysx.checkpoint.layer_state import KINDS
from sysx.checkpoint.reader import Checkpoint
from sysx.checkpoint.store import layer_filename
from sysx.checkpoint.streamed import StreamedLayer, TensorStream, layer_index, memory_stream
from sysx.model.flat import FlatLayout

FP32 = torch.float32
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class FileRegion:
    """A flat fp32 buffer stored in a state file from byte ``offset`` (a multiple of the I/O
    alignment): element ``i`` at byte ``offset + 4 i``."""

    path: str
    offset: int = 0


#: A flat fp32 state buffer in host memory, or where a state file holds one (a path: from byte 0).
FlatSource = torch.Tensor | FileRegion | str


def _region(src: FileRegion | str) -> FileRegion:
    return src if isinstance(src, FileRegion) else FileRegion(src)


class SpanIO(Protocol):
    """What the tier offers (:class:`sysx.optim.nvme.stream.StateStream`)."""

    def read_span(self, path: str, offset: int, nbytes: int) -> Iterator[memoryview]: ...

    def write_file(
        self, path: str, nbytes: int, fill: Callable[[int, memoryview], None], *, offset: int = 0
    ) -> None: ...


def _check_kinds(kinds: Mapping[str, FlatSource]) -> None:
    if set(kinds) != set(KINDS):
        raise ValueError(f"the flat state needs exactly the kinds {KINDS}, got {sorted(kinds)}")
    for kind, src in kinds.items():
        if isinstance(src, torch.Tensor) and src.dtype != FP32:
            raise ValueError(f"{kind}: the flat state is fp32, got {src.dtype}")


def tier_layer_sources(
    layout: FlatLayout,
    layer_indices: Sequence[int],
    kinds: Mapping[str, FlatSource],
    step: Callable[[], int],
    io: SpanIO,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[int, Callable[[], StreamedLayer]]:
    """Per-layer sources of streamed tensors; ``kinds`` maps ``weight``/``exp_avg``/``exp_avg_sq``
    to a host buffer or a state file (read when the save happens)."""
    _check_kinds(kinds)
    sources: dict[int, Callable[[], StreamedLayer]] = {}
    for index, entries in entries_by_layer(layout, layer_indices).items():

        def source(index: int = index, entries: list = entries) -> StreamedLayer:
            tensors = []
            for kind, src in kinds.items():
                for name, sl, shape in entries:
                    key = f"{kind}/{name}"
                    if isinstance(src, torch.Tensor):
                        tensors.append(memory_stream(key, src[sl].view(shape), chunk_bytes))
                        continue

                    region = _region(src)

                    def chunks(
                        path: str = region.path,
                        at: int = region.offset + sl.start * 4,
                        n: int = sl.stop * 4 - sl.start * 4,
                    ):
                        return io.read_span(path, at, n)

                    tensors.append(TensorStream(key, FP32, tuple(shape), chunks))
            return StreamedLayer(index, tensors, step())

        sources[index] = source
    return sources


class _Segments:
    """Where each byte range of one kind's flat buffer lies in the checkpoint's layer files."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.parts: list[tuple[int, int, str, int]] = []  # flat byte start, bytes, file, file offset

    def add(self, start: int, nbytes: int, path: str, offset: int) -> None:
        self.parts.append((start, nbytes, path, offset))

    def seal(self) -> None:
        self.parts.sort()
        self.starts = [p[0] for p in self.parts]

    def fill(self, fds: dict[str, int], start: int, view: memoryview) -> None:
        """Put the flat bytes ``start .. start + len(view)`` into ``view``."""
        end = start + len(view)
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.parts) and self.parts[i][0] < end:
            p_start, nbytes, path, offset = self.parts[i]
            lo, hi = max(start, p_start), min(end, p_start + nbytes)
            if lo < hi:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                target = view[lo - start : hi - start]
                got = os.preadv(fd, [target], offset + lo - p_start)
                while got < len(target):  # a short read of a regular file: go on from where it stopped
                    more = os.preadv(fd, [target[got:]], offset + lo - p_start + got)
                    if more == 0:
                        raise ValueError(f"{path}: ended {len(target) - got} bytes early; the checkpoint is damaged")
                    got += more
            i += 1


def _segments(
    ckpt: Checkpoint, layout: FlatLayout, layer_indices: Sequence[int], what: str, chunk_bytes: int
) -> tuple[dict[str, _Segments], set[int]]:
    by_kind = {kind: _Segments() for kind in KINDS}
    steps = set()
    for index, entries in entries_by_layer(layout, layer_indices).items():
        name_ = layer_filename(index)
        path = str(ckpt.verify(name_, chunk_bytes=chunk_bytes))
        tensors, metadata = layer_index(path)
        steps.add(int(metadata.get("step", 0)))
        for kind in KINDS:
            for name, sl, shape in entries:
                entry = tensors.get(f"{kind}/{name}")
                if entry is None:
                    raise ValueError(f"{what}: {kind}/{name} is missing from {name_}")
                if entry.shape != tuple(shape) or entry.dtype != FP32:
                    raise ValueError(
                        f"{what}: {kind}/{name} is {entry.dtype} {entry.shape}, this model needs float32 {tuple(shape)}"
                    )
                by_kind[kind].add(sl.start * 4, entry.nbytes, path, entry.offset)
    for segments in by_kind.values():
        segments.seal()
    return by_kind, steps


def restore_flat(
    ckpt: Checkpoint,
    layout: FlatLayout,
    layer_indices: Sequence[int],
    kinds: Mapping[str, FlatSource],
    io: SpanIO,
    *,
    what: str,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Fill each flat target of ``kinds`` (host buffer or state file) from ``ckpt``'s layer files,
    verified against the manifest first; returns the Adam step count the layers were saved at."""
    _check_kinds(kinds)
    by_kind, steps = _segments(ckpt, layout, layer_indices, what, chunk_bytes)
    if len(steps) != 1:
        raise ValueError(
            f"{what}: layers {sorted(set(layer_indices))} were saved at different Adam step counts {steps}"
        )
    nbytes = layout.numel * 4
    fds: dict[str, int] = {}
    try:
        for kind, target in kinds.items():
            segments = by_kind[kind]
            if isinstance(target, torch.Tensor):
                segments.fill(fds, 0, target[: layout.numel].view(torch.uint8).numpy().data)
            else:
                region = _region(target)
                io.write_file(region.path, nbytes, functools.partial(segments.fill, fds), offset=region.offset)
    finally:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    return steps.pop()
