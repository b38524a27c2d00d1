"""Shared-memory store across processes: zero-copy sharing, every exit path, SIGKILL, small tmpfs.

Children are small scripts run with ``subprocess``; most use only the segment layer (no torch
import, ~0.1 s each). Exit paths covered: normal end, uncaught exception, SIGTERM, Ctrl-C (SIGINT),
explicit close, owner and attacher SIGTERMed together (torchrun style), an attacher SIGKILLed
(owner still closes promptly), the creator SIGKILLed with the guardian (cleaned at once) and
without it (stale -> ``sysx shm list`` / ``clean``, and a restart with the same job id works).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from sysx.memory import cleanup
from sysx.memory.names import segment_name
from sysx.memory.segment import Segment, SegmentExistsError
from sysx.memory.store import SharedParamStore, StageSpec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SEGMENT_CHILD = r"""
import os, sys, time
from sysx.memory.names import segment_name
from sysx.memory.segment import Segment
mode, job, what = sys.argv[1], sys.argv[2], sys.argv[3]
name = segment_name(what, job=job, node=0)
if mode == "attach":
    seg = Segment.attach(name, timeout_s=10)
else:
    seg = Segment.create(name, 1 << 20)
print("ready", flush=True)
if mode == "exception":
    raise RuntimeError("boom")
if mode in ("normal",):
    sys.exit(0)
if mode == "close":
    line = sys.stdin.readline()
    started = time.monotonic()
    seg.close(timeout_s=20)
    print(f"closed {time.monotonic() - started:.3f}", flush=True)
    sys.exit(0)
time.sleep(60)  # wait for a signal
sys.exit(5)
"""

TORCH_CHILD = r"""
import sys, torch
from sysx.memory.store import SharedParamStore
store = SharedParamStore(job=sys.argv[1], node=0, sweep=False)
stage = store.attach("s0", timeout_s=20)
bf16, fp32 = stage[torch.bfloat16], stage[torch.float32]
for section in stage.spec.layout():  # the tensors are the mapping itself: no copy
    assert stage[section.dtype].data_ptr() == stage.segment.data_address + section.byte_offset
assert torch.all(bf16 == 1.5), bf16[:4]
fp32.copy_(torch.arange(fp32.numel(), dtype=torch.float32))
print("wrote", flush=True)
assert sys.stdin.readline().strip() == "check"
print("sees", float(bf16[0]), flush=True)
del bf16, fp32, stage
store.close()
"""


@pytest.fixture
def job() -> str:
    job_id = f"p{uuid.uuid4().hex[:10]}"
    yield job_id
    leftovers = cleanup.scan(job=job_id)
    for info in leftovers:
        cleanup.remove(info)
    assert not leftovers, f"test left segments behind: {[i.name for i in leftovers]}"


_children: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _reap_children() -> None:
    """Kill whatever a test left running and close its pipes."""
    yield
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("SYSX_JOB_ID", None)
    return env


def _interactive_signals() -> None:
    """Give the child the SIGINT and SIGHUP of a process started from a terminal. A job started in
    the background by a non-interactive shell (as CI may be) inherits SIGINT ignored, one started
    under ``nohup`` SIGHUP ignored, and sysx rightly leaves an ignored signal alone, so those exit
    paths could not be exercised otherwise."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _spawn(script: str, *args: str, guardian: bool = False, **popen: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(SYSX_SHM_GUARDIAN="1" if guardian else "0"),
        preexec_fn=_interactive_signals,
        **popen,
    )
    _children.append(proc)
    return proc


def _ready(proc: subprocess.Popen[str]) -> None:
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")


def _sysx(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sysx.cli", "shm", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
        check=True,
    )
    return done.stdout


def _gone_within(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_two_processes_share_writes_without_copies(job: str) -> None:
    spec = StageSpec.of("s0", {torch.bfloat16: 4096, torch.float32: 1000})
    store = SharedParamStore(job=job, node=0)
    stage = store.create(spec)
    path = stage.segment.name.path
    assert os.stat(path).st_mode & 0o777 == 0o600
    stage[torch.bfloat16].fill_(1.5)
    child = _spawn(TORCH_CHILD, job)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.strip() == "wrote", child.stderr.read() if child.stderr else line
        # the child's writes are visible through our own tensor: same physical pages, no copy
        assert torch.equal(stage[torch.float32], torch.arange(1000, dtype=torch.float32))
        stage[torch.bfloat16][0] = 7.0
        child.stdin.write("check\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["sees", "7.0"]
        assert child.wait(30) == 0, child.stderr.read() if child.stderr else ""
    finally:
        child.kill()
        del stage
        store.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(
    ("mode", "send", "returncode"),
    [
        ("normal", None, 0),
        ("exception", None, 1),
        ("sleep", signal.SIGTERM, -signal.SIGTERM),
        ("sleep", signal.SIGINT, -signal.SIGINT),  # Ctrl-C: KeyboardInterrupt, then atexit
        ("sleep", signal.SIGHUP, -signal.SIGHUP),
    ],
)
def test_exit_paths_unlink_owned_segments(job: str, mode: str, send: signal.Signals | None, returncode: int) -> None:
    """Without the guardian: the process's own exit handling removes its segment."""
    proc = _spawn(SEGMENT_CHILD, mode, job, "p.a")
    _ready(proc)
    path = segment_name("p.a", job=job, node=0).path
    if send is not None:
        assert os.path.exists(path)
        proc.send_signal(send)
    assert proc.wait(30) == returncode, proc.stderr.read() if proc.stderr else ""
    assert not os.path.exists(path)
    if mode == "exception":
        assert "RuntimeError: boom" in (proc.stderr.read() if proc.stderr else "")


def _create_and_return(job: str) -> None:
    Segment.create(segment_name("p.mp", job=job, node=0), 4096)  # no close: the child just returns


def test_multiprocessing_fork_child_cleans_up_on_return(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked multiprocessing child leaves through os._exit (no atexit); its segment still goes.
    (A spawned child ends with sys.exit, i.e. the atexit path the subprocess tests cover.)"""
    import multiprocessing

    monkeypatch.setenv("SYSX_SHM_GUARDIAN", "0")  # prove the in-process path, not the guardian
    child = multiprocessing.get_context("fork").Process(target=_create_and_return, args=(job,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert not os.path.exists(segment_name("p.mp", job=job, node=0).path)


def test_sigterm_to_owner_and_attacher_together(job: str) -> None:
    """torchrun stops every rank with SIGTERM: nobody waits on anybody, nothing is left."""
    owner = _spawn(SEGMENT_CHILD, "sleep", job, "p.a")
    _ready(owner)
    reader = _spawn(SEGMENT_CHILD, "attach", job, "p.a")
    _ready(reader)
    with pytest.raises(SegmentExistsError, match=r"(?s)is alive.*another sysx job.*SYSX_JOB_ID"):
        Segment.create(segment_name("p.a", job=job, node=0), 4096)  # a second job with the same id
    started = time.monotonic()
    owner.send_signal(signal.SIGTERM)
    reader.send_signal(signal.SIGTERM)
    assert owner.wait(30) == -signal.SIGTERM and reader.wait(30) == -signal.SIGTERM
    assert time.monotonic() - started < 8  # under the owner's 10 s detach timeout on a signal: nobody waited
    assert not os.path.exists(segment_name("p.a", job=job, node=0).path)


def test_attacher_killed_owner_closes_promptly(job: str) -> None:
    owner = _spawn(SEGMENT_CHILD, "close", job, "p.a")
    _ready(owner)
    reader = _spawn(SEGMENT_CHILD, "attach", job, "p.a")
    _ready(reader)
    reader.kill()  # SIGKILL: the kernel drops its lock
    reader.wait(10)
    assert owner.stdin is not None and owner.stdout is not None
    owner.stdin.write("close\n")
    owner.stdin.flush()
    word, seconds = owner.stdout.readline().split()
    assert word == "closed" and float(seconds) < 10.0  # half its 20 s timeout: it did not wait for the dead reader
    assert owner.wait(30) == 0
    assert not os.path.exists(segment_name("p.a", job=job, node=0).path)


def test_sigkill_with_guardian_removes_segments(job: str) -> None:
    """The guardian, not another pytest worker's job start, removes the killed creator's segment:
    that start's sweep removes stale segments too, and once took this one first (the guardian then
    found nothing to remove and said nothing), so the test holds the sweep lock meanwhile."""
    proc = _spawn(SEGMENT_CHILD, "sleep", job, "p.a", guardian=True)
    _ready(proc)
    path = segment_name("p.a", job=job, node=0).path
    with cleanup.sweep_lock() as held:
        assert held, "another process held the sweep lock for 30 s"
        proc.kill()
        proc.wait(10)
        assert _gone_within(path, 10)
        assert "removed its segment" in (proc.stderr.read() if proc.stderr else "")


def test_sigkill_without_guardian_is_stale_cleanable_and_restartable(job: str) -> None:
    """The worst case (guardian killed too, e.g. the whole cgroup): stale, listed, cleaned, and a new
    job with the same id starts. The sweep lock keeps another pytest worker's job starts from
    sweeping the stale segments while the test looks at them."""
    with cleanup.sweep_lock() as held:
        assert held, "another process held the sweep lock for 30 s"
        _stale_listed_cleaned_restarted(job)


def _stale_listed_cleaned_restarted(job: str) -> None:
    first = _spawn(SEGMENT_CHILD, "sleep", job, "p.a")
    _ready(first)
    second = _spawn(SEGMENT_CHILD, "sleep", job, "p.s0")
    _ready(second)
    for proc in (first, second):
        proc.kill()
        proc.wait(10)
    a, s0 = (segment_name(w, job=job, node=0) for w in ("p.a", "p.s0"))
    assert os.path.exists(a.path) and os.path.exists(s0.path)  # SIGKILL leaves them
    listing = _sysx("list", "--job", job)
    for name, pid in ((a, first.pid), (s0, second.pid)):
        row = next((line for line in listing.splitlines() if line.startswith(name.name)), f"no row in:\n{listing}")
        assert f" {pid} " in row and row.rstrip().endswith("stale") and "1.0 MiB" in row
    assert "2 stale" in listing and "`sysx shm clean`" in listing
    # a restart with the same job id replaces its stale segment instead of failing
    store = SharedParamStore(job=job, node=0, sweep=False)
    with pytest.warns(RuntimeWarning, match="replacing stale"):
        stage = store.create(StageSpec.of("s0", {torch.bfloat16: 1024}))
    cleaned = _sysx("clean", "--job", job)
    assert f"removed {a.name}" in cleaned and s0.name not in cleaned
    assert not os.path.exists(a.path) and os.path.exists(s0.path)
    listing = _sysx("list", "--job", job)
    assert listing.count("alive") == 1 and "stale" not in listing.splitlines()[1]
    del stage
    store.close()
    assert not os.path.exists(s0.path)


SWEEP_CHILD = r"""
import sys, warnings
from sysx.memory import cleanup
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    removed = cleanup.sweep_stale(job=sys.argv[1], wait_s=float(sys.argv[2]))
print("removed", " ".join(info.name for info in removed) or "-")
print("warned", " | ".join(str(w.message) for w in caught) or "-")
"""

LOCK_CHILD = r"""
import time
from sysx.memory import cleanup
with cleanup.sweep_lock(wait_s=60) as held:
    print("ready" if held else "not held", flush=True)
    time.sleep(60)  # until killed
"""


def test_the_sweep_lock_keeps_other_starts_off_and_dies_with_its_holder(job: str) -> None:
    """While a process holds the sweep lock another process's sweep waits and then leaves the stale
    segments alone; the holder's own sweep goes on (reentrant); a SIGKILLed holder frees it."""
    a = segment_name("p.a", job=job, node=0)
    with cleanup.sweep_lock() as held:
        assert held
        first = _spawn(SEGMENT_CHILD, "sleep", job, "p.a")
        _ready(first)
        first.kill()
        first.wait(10)
        done = subprocess.run(
            [sys.executable, "-c", SWEEP_CHILD, job, "0.5"], capture_output=True, text=True, env=_env(), timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "removed -" in done.stdout and "held the shared-memory sweep lock for 0.5 s" in done.stdout
        assert os.path.exists(a.path)
        assert [info.name for info in cleanup.sweep_stale(job=job, wait_s=0.5)] == [a.name]
    holder = _spawn(LOCK_CHILD)
    _ready(holder)
    with cleanup.sweep_lock(wait_s=0.3) as held:
        assert not held
    holder.kill()
    holder.wait(10)
    with cleanup.sweep_lock(wait_s=30) as held:
        assert held


TMPFS_SCRIPT = r"""
import os
from sysx.memory.budget import ShmBudgetError
from sysx.memory.names import segment_name
from sysx.memory.segment import Segment
name = segment_name("p.big", job="tmpfs", node=0)
for check in (True, False):
    try:
        Segment.create(name, 4 << 20, check_space=check)
        print("CREATED")
    except ShmBudgetError as exc:
        print("ERROR", " ".join(str(exc).split()))
    print("LEFT", sorted(os.listdir("/dev/shm")))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a private tmpfs"
)
def test_real_small_tmpfs_refuses_before_allocating() -> None:
    """A 1 MiB /dev/shm (a private mount namespace, like a container's 64 MB default)."""
    shell = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c '{TMPFS_SCRIPT}'"
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", shell], capture_output=True, text=True, env=_env(), timeout=60
    )
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {done.stderr.strip()}")
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout + done.stderr
    budget_error, left1, falloc_error, left2 = lines
    assert budget_error.startswith("ERROR") and "needs 4.0 MiB" in budget_error and "only 1.0 MiB" in budget_error
    assert "nothing was allocated" in budget_error and "--shm-size=1g" in budget_error
    assert falloc_error.startswith("ERROR could not reserve 4.0 MiB") and "No space left on device" in falloc_error
    assert left1 == left2 == "LEFT []"  # nothing created by the check, nothing left by the failed reserve
