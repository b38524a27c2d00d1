"""The NVMe tier's state directories (sysx.optim.nvme.files): named like the shared-memory segments,
reserved before training (a full disk is one line), removed on every exit path, and a dead job's
leftovers swept by the next job and by ``sysx nvme clean``."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from sysx.memory import cleanup
from sysx.memory.names import current_user
from sysx.optim.nvme import ALIGN, DiskFull, StateDir, scan_state_dirs, sweep_state_dirs
from sysx.optim.nvme import cli as nvme_cli
from sysx.optim.nvme import files as files_mod


@pytest.fixture
def job() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def _forge_dead_owner(state: StateDir) -> None:
    """Make ``state`` look left behind by a dead process: our pid with another start time (a reused
    pid), and its lock dropped as the kernel drops a dead process's."""
    marker = Path(state.path) / files_mod.MARKER
    owner = json.loads(marker.read_text())
    owner["start"] += 1
    marker.write_text(json.dumps(owner))
    cleanup.unregister_exit_hook(state.close)
    os.close(state._lock_fd)
    state._closed = True  # its process is "dead": nothing of it may run later (the fd number is reused)


def test_name_marker_reserve_and_close(tmp_path: Path, job: str) -> None:
    state = StateDir(str(tmp_path), job=job, node=3, rank=5)
    try:
        assert os.path.basename(state.path) == f"sysx-{current_user()}-{job}-3-nvme.r5"
        assert os.stat(state.path).st_mode & 0o777 == 0o700
        owner = json.loads((Path(state.path) / "owner.json").read_text())
        assert owner["pid"] == os.getpid() and owner["host"]
        paths = state.reserve({"s0.p": 10, "s0.m": 3 * ALIGN})
        assert {n: os.path.getsize(p) for n, p in paths.items()} == {"s0.p": ALIGN, "s0.m": 3 * ALIGN}
        assert all(os.stat(p).st_blocks * 512 >= os.path.getsize(p) for p in paths.values())  # allocated
        assert state.reserved_bytes == 4 * ALIGN
        [info] = scan_state_dirs(str(tmp_path), job=job)
        assert info.status == "alive" and info.owner is not None and info.owner.pid == os.getpid()
        with pytest.raises(ValueError, match="must match"):
            state.file("../escape")
        with pytest.raises(FileExistsError, match=r"\(alive\).*SYSX_JOB_ID"):
            StateDir(str(tmp_path), job=job, node=3, rank=5)
    finally:
        state.close()
    assert not os.path.exists(state.path) and state.closed
    state.close()  # idempotent


def test_removed_on_exceptions_and_exit_paths(tmp_path: Path, job: str) -> None:
    hooks = len(cleanup._exit_hooks)
    with pytest.raises(RuntimeError, match="boom"), StateDir(str(tmp_path), job=job, node=0, rank=0) as state:
        state.reserve({"a": ALIGN})
        raise RuntimeError("boom")
    assert not os.path.exists(state.path) and len(cleanup._exit_hooks) == hooks  # its hook went with it
    state = StateDir(str(tmp_path), job=job, node=0, rank=1)
    cleanup.release_all(timeout_s=1.0)  # what atexit, SIGTERM/SIGHUP and Ctrl-C (via atexit) run
    assert not os.path.exists(state.path) and state.closed


def test_full_disk_is_one_line_before_training(tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = StateDir(str(tmp_path), job=job, node=0, rank=0)
    try:
        monkeypatch.setattr(files_mod, "free_bytes", lambda directory: 5 * ALIGN)
        with pytest.raises(DiskFull) as err:
            state.reserve({"m": 4 * ALIGN, "v": 4 * ALIGN})
        text = str(err.value)
        assert "\n" not in text and err.value.errno == errno.ENOSPC
        assert f"optim.nvme_dir={tmp_path}" in text and "need 32.0 KiB" in text and "has 20.0 KiB free" in text
        assert "optim.offload=host" in text
        assert os.listdir(state.path) == ["owner.json"]  # nothing half-reserved
    finally:
        state.close()


def test_enospc_from_fallocate_is_the_same_line(tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """statvfs said yes, the allocation says no (another rank took the space meanwhile)."""
    state = StateDir(str(tmp_path), job=job, node=0, rank=0)
    calls = []

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.ftruncate(fd, length)

    try:
        monkeypatch.setattr(files_mod.os, "posix_fallocate", fallocate)
        with pytest.raises(DiskFull, match=r"need 8.0 KiB but the file system has .* free; fix: "):
            state.reserve({"m": ALIGN, "v": ALIGN})
        assert os.listdir(state.path) == ["owner.json"]  # the first file is removed again
    finally:
        state.close()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 64 KiB file system (a tmpfs; mounting needs root, which CI may not have)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({made.stderr.decode().strip()}); the monkeypatched tests cover it"
        )
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk(small_fs: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by the free-space check, and, with that check fooled, by posix_fallocate's own ENOSPC."""
    state = StateDir(str(small_fs), job=job, node=0, rank=0)
    try:
        with pytest.raises(DiskFull, match=rf"optim.nvme_dir={small_fs}: .* need 1.0 MiB but the file system has"):
            state.reserve({"m": 1 << 20})
        monkeypatch.setattr(files_mod, "free_bytes", lambda directory: 1 << 40)
        with pytest.raises(DiskFull, match=r"need 1.0 MiB but the file system has .* free; fix: ") as err:
            state.reserve({"m": 1 << 20})  # the check passes: the allocation itself meets the full disk
        assert err.value.errno == errno.ENOSPC
        assert os.listdir(state.path) == ["owner.json"]
    finally:
        state.close()


def test_a_disk_too_full_for_the_owner_record(tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(self: StateDir, started: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StateDir, "_write_owner", no_space)
    with pytest.raises(DiskFull, match=rf"optim.nvme_dir={tmp_path}: .* need 4.0 KiB .*; fix: "):
        StateDir(str(tmp_path), job=job, node=0, rank=0)
    assert os.listdir(tmp_path) == []  # the half-made directory is gone


def test_dead_jobs_leftovers_are_swept_by_the_next_job_and_the_command(
    tmp_path: Path, job: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = StateDir(str(tmp_path), job=job, node=0, rank=0)
    first.reserve({"m": ALIGN})
    marker = Path(first.path) / files_mod.MARKER
    marker.write_text(marker.read_text().replace(f'"pid": {os.getpid()}', '"pid": 1'))
    # a creator whose pid means nothing here (another pid namespace) but that holds the lock: in use
    assert [i.status for i in scan_state_dirs(str(tmp_path))] == ["orphaned"] and not sweep_state_dirs(str(tmp_path))
    _forge_dead_owner(first)
    assert [i.status for i in scan_state_dirs(str(tmp_path))] == ["stale"]
    assert nvme_cli.main(["list", str(tmp_path)]) == 0
    assert "stale" in capsys.readouterr().out
    assert nvme_cli.main(["clean", str(tmp_path)]) == 0
    assert f"removed {first.path}" in capsys.readouterr().out and not os.path.exists(first.path)

    second = StateDir(str(tmp_path), job=job, node=0, rank=0)  # same job id, restarted
    _forge_dead_owner(second)
    other = StateDir(str(tmp_path), job=f"{job}x", node=0, rank=0)  # a later job sweeps at its start
    try:
        assert not os.path.exists(second.path)
        assert [i.path for i in scan_state_dirs(str(tmp_path))] == [other.path]
        assert sweep_state_dirs(str(tmp_path)) == []  # the live one stays
    finally:
        other.close()


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    # a shell's background job starts with SIGINT ignored, and Python then leaves it ignored: Ctrl-C
    # is what this child must see
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from sysx.optim.nvme import StateDir
    state = StateDir(sys.argv[1], job=sys.argv[2], node=0, rank=0)
    state.reserve({"m": 8192})
    print(state.path, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.slow
def test_signals(tmp_path: Path, job: str) -> None:
    """SIGTERM and Ctrl-C remove the directory at once, SIGKILL through the guardian process; with the
    guardian off (or killed too) SIGKILL leaves it stale for the next sweep. The four children start
    together (one interpreter start-up of waiting, not four)."""
    cases = [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGKILL, True), (signal.SIGKILL, False)]
    procs = []
    for i, (_, guardian) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        env = {**os.environ, "SYSX_SHM_GUARDIAN": "1" if guardian else "0"}
        cmd = [sys.executable, "-c", CHILD, str(tmp_path / str(i)), job]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    paths = []
    for proc in procs:
        assert proc.stdout is not None
        paths.append(proc.stdout.readline().strip())
        assert os.path.isdir(paths[-1])
    for proc, (sig, _) in zip(procs, cases):
        proc.send_signal(sig)
    for proc, path, (sig, guardian) in zip(procs, paths, cases):
        proc.wait(30)
        root = os.path.dirname(path)
        if sig == signal.SIGKILL and not guardian:
            assert [i.status for i in scan_state_dirs(root)] == ["stale"]
            assert [i.path for i in sweep_state_dirs(root)] == [path]
        elif sig == signal.SIGKILL:
            deadline = time.monotonic() + 10
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.stderr is not None and "removed its scratch directory" in proc.stderr.read()
        assert not os.path.exists(path), (sig, guardian)
