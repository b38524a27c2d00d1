"""The NVMe tier's I/O engines (sysx.optim.nvme.io, .aio) and the disk probe: whole-buffer reads and
writes are bit-exact on both engines, errors name the file, bytes and errno, and the fallbacks
(no O_DIRECT, no libaio) each say so in one warning line.

The aio cases run where DeepSpeed's async_io op is usable and already built (libaio is absent on
CI: skipped there, with the reason); the same contract is tested on the threads engine everywhere.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from sysx.memory.pinned import PinnedStaging
from sysx.optim.nvme import ALIGN, IoError, aligned_nbytes, measure_disk, open_engine
from sysx.optim.nvme import aio as aio_mod
from sysx.optim.nvme import engine as engine_mod
from sysx.optim.nvme import io as io_mod


def _aio_skip_reason() -> str | None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:
        return f"deepspeed's AsyncIOBuilder does not import ({exc})"
    from sysx.optim.deepspeed_backend import extensions_dir, quiet_cpu_accelerator

    quiet_cpu_accelerator()
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "no libaio here (apt install libaio-dev); the threads engine covers the same contract"
    if not (extensions_dir() / "async_io" / "async_io.so").exists():
        return "the async_io op is not built yet (sysx nvme build-aio builds it, ~3 min)"
    return None


_AIO_SKIP = _aio_skip_reason()
ENGINES = ["threads", pytest.param("aio", marks=pytest.mark.skipif(_AIO_SKIP is not None, reason=str(_AIO_SKIP)))]


@pytest.fixture
def buffers() -> tuple[PinnedStaging, PinnedStaging]:
    """Two page-aligned buffers of 3 ALIGN-blocks plus a bit (rounded up by aligned_nbytes)."""
    nbytes = aligned_nbytes(3 * ALIGN + 100)
    pair = (PinnedStaging(nbytes, label="src"), PinnedStaging(nbytes, label="dst"))
    yield pair
    for staging in pair:
        staging.close()


def _random(staging: PinnedStaging, dtype: torch.dtype) -> torch.Tensor:
    numel = staging.nbytes // dtype.itemsize
    t = staging.view(dtype, numel)
    t.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(7)).to(dtype))
    return t


def test_aligned_nbytes() -> None:
    assert [aligned_nbytes(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        aligned_nbytes(-1)


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_then_read_is_bit_exact(tmp_path: Path, kind: str, dtype: torch.dtype, buffers) -> None:
    src, dst = buffers
    engine = open_engine(kind, str(tmp_path))
    try:
        direct = io_mod.probe_direct(str(tmp_path))  # False on an old kernel's tmpfs: then buffered threads
        assert (engine.name, engine.direct) == ((kind, True) if direct else ("threads", False))
        data = _random(src, dtype)
        out = dst.view(dtype, data.numel())
        path = str(tmp_path / "state.bin")
        engine.write(path, data).result()
        assert os.path.getsize(path) == src.nbytes
        engine.read(path, out).result()
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
        # a part of the file at an aligned offset (the checkpoint reads chunks so)
        part = dst.view(torch.uint8, ALIGN)
        engine.read(path, part, offset=2 * ALIGN).result()
        assert torch.equal(part, src.view(torch.uint8, src.nbytes)[2 * ALIGN : 3 * ALIGN])
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_buffer_is_free_once_its_future_is_done(tmp_path: Path, kind: str) -> None:
    """The owner may free a buffer the moment its request completes: no engine thread still holds a
    view of it then (PinnedStaging.close raises LiveViewsError while one does)."""
    engine = open_engine(kind, str(tmp_path))
    path = str(tmp_path / "f")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches everywhere: a worker caught holding a view shows up
    try:
        for i in range(60):
            staging = PinnedStaging(ALIGN, label="short-lived")
            view = staging.view(torch.uint8, ALIGN)
            future = engine.write(path, view) if i % 2 == 0 else engine.read(path, view)
            del view
            future.result()
            staging.close()
    finally:
        sys.setswitchinterval(interval)
        engine.close()


def test_threads_engine_splits_into_blocks(tmp_path: Path, buffers) -> None:
    """Blocks smaller than the buffer: several requests per op, still one Future and the same bytes."""
    src, dst = buffers
    engine = io_mod.ThreadsEngine(direct=True, threads=3, block_bytes=ALIGN)
    try:
        data = _random(src, torch.float32)
        out = dst.view(torch.float32, data.numel())
        futures = [engine.write(str(tmp_path / f"f{i}"), data) for i in range(3)]
        for f in futures:
            f.result()
        engine.read(str(tmp_path / "f2"), out).result()
        assert torch.equal(out, data)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_errors_name_file_bytes_and_errno(tmp_path: Path, kind: str, buffers) -> None:
    src, _ = buffers
    engine = open_engine(kind, str(tmp_path))
    try:
        missing = str(tmp_path / "missing.bin")
        with pytest.raises(IoError, match=rf"read of {src.nbytes} bytes at offset 0 of {missing} failed: errno 2"):
            engine.read(missing, src.view(torch.uint8, src.nbytes)).result()
        short = tmp_path / "short.bin"
        short.write_bytes(b"x" * ALIGN)
        with pytest.raises(IoError, match=rf"short read of {short}: wanted {src.nbytes} bytes.*after {ALIGN}") as err:
            engine.read(str(short), src.view(torch.uint8, src.nbytes)).result()
        assert err.value.errno == errno.EIO
        misaligned = src.view(torch.uint8, src.nbytes)[1 : 1 + ALIGN]
        with pytest.raises(ValueError, match=f"multiples of {ALIGN}.*PinnedStaging"):
            engine.write(str(tmp_path / "x"), misaligned)
    finally:
        engine.close()


def test_eio_mid_read_names_the_file(tmp_path: Path, buffers, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = buffers
    engine = open_engine("threads", str(tmp_path))
    path = str(tmp_path / "state.bin")
    try:
        engine.write(path, src.view(torch.uint8, src.nbytes)).result()

        def broken(*args: object) -> int:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(io_mod.os, "preadv", broken)
        with pytest.raises(IoError, match=rf"read of {dst.nbytes} bytes at offset 0 of {path} failed: errno 5"):
            engine.read(path, dst.view(torch.uint8, dst.nbytes)).result()
    finally:
        engine.close()


def test_no_o_direct_falls_back_to_buffered_with_one_warning(
    tmp_path: Path, buffers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses O_DIRECT (EINVAL at open, as older tmpfs and some network file
    systems do; this kernel's tmpfs accepts it, so the refusal is simulated)."""
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(io_mod.os, "open", refusing_open)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = open_engine("aio", str(tmp_path))
    try:
        assert (engine.name, engine.direct) == ("threads", False)
        assert len(caught) == 1 and "\n" not in str(caught[0].message)
        assert f"{tmp_path} refuses O_DIRECT" in str(caught[0].message)
        src, dst = buffers
        engine.write(str(tmp_path / "s"), src.view(torch.uint8, src.nbytes)).result()
        engine.read(str(tmp_path / "s"), dst.view(torch.uint8, dst.nbytes)).result()
        assert torch.equal(src.view(torch.uint8, src.nbytes), dst.view(torch.uint8, dst.nbytes))
    finally:
        engine.close()


def test_auto_without_aio_warns_once_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_mod, "unavailable_reason", lambda: "no libaio")
    monkeypatch.setattr(engine_mod, "probe_direct", lambda directory: True)  # only the libaio warning here
    monkeypatch.setattr(engine_mod, "cuda_available", lambda: True)  # a GPU host, where auto wants aio
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = open_engine("auto", str(tmp_path))
    engine.close()
    assert engine.name == "threads"
    assert len(caught) == 1 and "no libaio" in str(caught[0].message)
    assert "apt install libaio-dev" in str(caught[0].message)


def test_auto_without_cuda_takes_threads_silently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA no buffer is pinned for the aio op, which would copy every request through a
    bounce buffer of its size: auto takes threads, and asks nothing of the aio op."""
    monkeypatch.setattr(engine_mod, "cuda_available", lambda: False)
    monkeypatch.setattr(aio_mod, "unavailable_reason", lambda: pytest.fail("the aio op was consulted"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = open_engine("auto", str(tmp_path))
    engine.close()
    assert engine.name == "threads"


def test_bad_engine_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"optim.nvme_engine='spdk': choose one of auto, aio, threads"):
        open_engine("spdk", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"optim.nvme_dir=.*nope.* is not a directory"):
        open_engine("threads", str(tmp_path / "nope"))


def test_a_directory_without_write_access_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(io_mod.os, "open", denied)  # root ignores modes: the refusal is simulated
    with pytest.raises(OSError, match=rf"optim.nvme_dir={tmp_path} cannot hold state files \(Permission denied, "):
        open_engine("threads", str(tmp_path))


def test_measure_disk_is_a_short_pure_probe(tmp_path: Path) -> None:
    profile = measure_disk(str(tmp_path), 4 << 20, engine="threads", request_bytes=1 << 20)
    assert profile.engine == "threads" and profile.direct == io_mod.probe_direct(str(tmp_path))
    assert profile.read_Bps > 0 and profile.write_Bps > 0 and profile.free_bytes > 0
    assert sorted(profile.to_dict()) == ["direct", "engine", "free_bytes", "read_Bps", "write_Bps"]
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_a_killed_aio_build_does_not_hang_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build killed mid-way leaves torch's ``lock`` in the op's build folder, and torch's next build
    would wait on it forever: the next build removes it once it is older than any build (as cpu_adam's)."""
    from deepspeed.ops import op_builder

    from sysx.optim.deepspeed_backend import STALE_LOCK_S

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    lock.touch()
    old = os.path.getmtime(lock) - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    seen: list[bool] = []

    class Builder:  # the real one compiles for minutes; what matters is the lock it finds
        def is_compatible(self, verbose: bool = False) -> bool:
            return True

        def load(self, verbose: bool = False) -> str:
            seen.append(lock.exists())
            return "op"

    monkeypatch.setattr(op_builder, "AsyncIOBuilder", Builder)
    assert aio_mod._build() == "op" and seen == [False]
