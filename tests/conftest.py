"""Shared test setup: GPU marker handling and the end-of-suite shared-memory leak check."""

from __future__ import annotations

import os

import pytest
import torch

SHM_DIR = "/dev/shm"
SHM_PREFIX = "sysx"


def _sysx_segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


_segments_before_suite: set[str] = set()


def _left_by_this_suite(name: str) -> bool:
    """A new segment is this suite's leak unless a live process other than this one created it (a
    job or another test run beside this one on a shared machine, still using it)."""
    from sysx.memory.cleanup import inspect

    info = inspect(os.path.join(SHM_DIR, name))
    if info is None:  # gone meanwhile
        return False
    return info.status != "alive" or info.creator_pid == os.getpid()


def pytest_configure(config: pytest.Config) -> None:
    _segments_before_suite.update(_sysx_segments())
    # each of the suite's workers (-n 2 on the 2-core CI machine) owns a core: the jobs a test starts,
    # and this process's threads that have not computed yet (torch reads it at a thread's first
    # parallel op), compute with one intra-op thread. Two threads' OpenMP team spins for its partner
    # while the other worker's test holds the second core: the default job's test took 46 s, not 26
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from intra-op threads; on a shared 2-core machine they spin-wait.
    Modules of tiny-model tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def dispatch_mode_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the window's two dispatch modes during the test, by class (``Capture``, ``Replay``):
    each is one Python call per aten op, the host cost a plain or kept forward avoids."""
    from sysx.single import act_capture

    calls = {"Capture": 0, "Replay": 0}
    for mode in (act_capture.Capture, act_capture.Replay):
        dispatch = mode.__torch_dispatch__

        def counted(self, *args, _dispatch=dispatch, _name=mode.__name__, **kwargs):
            calls[_name] += 1
            return _dispatch(self, *args, **kwargs)

        monkeypatch.setattr(mode, "__torch_dispatch__", counted)
    return calls


@pytest.fixture
def nvtx_ranges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The NVTX ranges opened during the test, as ``(name, thread name)``: ``nvtx.annotate`` is a
    stand-in that notes them; ranges are on only if the test turns them on, and off again after it."""
    import contextlib
    import threading

    import nvtx

    from sysx.trace import ranges

    seen: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def annotate(name: str, domain: str | None = None):
        seen.append((name, threading.current_thread().name))
        yield

    monkeypatch.setattr(nvtx, "annotate", annotate)
    monkeypatch.setattr(ranges, "_enabled", False)
    return seen


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if the suite left sysx shared-memory segments behind."""
    leaked = sorted(name for name in _sysx_segments() - _segments_before_suite if _left_by_this_suite(name))
    if leaked:
        print(f"\nLEAK: the test suite left {len(leaked)} shared-memory segment(s) in {SHM_DIR}: {leaked}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
