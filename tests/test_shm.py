"""Shared-memory store, single process: names, segment lifecycle, budgets, pinned buffers, CLI.

Multi-process behaviour (other processes, signals, SIGKILL, a real small tmpfs) is in
test_shm_procs.py. Every test uses its own job id and the ``job`` fixture fails it if a segment of
that job is left behind.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sysx.memory import budget, cleanup, names, pinned, procinfo
from sysx.memory.cli import main as shm_main
from sysx.memory.header import _FIXED, CREATOR_OFFSET, HEADER_BYTES, LAYOUT_VERSION, STATE_READY, SegmentError
from sysx.memory.names import SegmentName, resolve_job_id, segment_name
from sysx.memory.segment import Segment, SegmentExistsError
from sysx.memory.store import SharedParamStore, StageSpec
from sysx.memory.views import LiveViewsError

MiB = 1 << 20


@pytest.fixture
def job() -> str:
    """A fresh job id; fails the test if any segment of it survives the test."""
    job_id = f"t{uuid.uuid4().hex[:10]}"
    yield job_id
    leftovers = cleanup.scan(job=job_id)
    for info in leftovers:
        cleanup.remove(info)
    assert not leftovers, f"test left segments behind: {[i.name for i in leftovers]}"


@pytest.fixture
def sweeps_held() -> Iterator[None]:
    """Hold this user's sweep lock: another pytest worker's job start must not remove the stale
    segments this test forges before it has looked at them."""
    with cleanup.sweep_lock() as held:
        assert held, "another process held the sweep lock for 30 s"
        yield


def _exists(name: SegmentName) -> bool:
    return os.path.exists(name.path)


def _forge_stale(name: SegmentName, data_bytes: int = 4096) -> None:
    """Leave a segment behind whose creator pid was 'reused': our pid with another start time."""
    seg = Segment.create(name, data_bytes, register=False)
    pid, started = procinfo.self_identity()
    os.pwrite(seg._fd, struct.pack("<qQ", pid, started + 1), CREATOR_OFFSET)
    seg._shm.close_fd()  # drop our lock, as a dead process would; the mapping itself is harmless


# --- names and job ids -------------------------------------------------------------------------
def test_names_carry_user_job_node_and_parse_back() -> None:
    name = segment_name("p.s1.0", job="run-42/a", node=3, user="jo-hn")
    assert name.name == "/sysx-jo_hn-run_42_a-3-p.s1.0"
    assert name.path == "/dev/shm/sysx-jo_hn-run_42_a-3-p.s1.0"
    assert SegmentName.parse(name.name) == name
    assert SegmentName.parse("sysx-only-three") is None
    assert SegmentName.parse("psm_1234") is None
    with pytest.raises(ValueError, match=r"A-Za-z0-9_\."):
        segment_name("p.bad-key", job="j", node=0)
    long_job = names.sanitize("x" * 100, max_len=40)
    assert len(long_job) == 40 and long_job == names.sanitize("x" * 100, max_len=40)
    assert long_job != names.sanitize("x" * 99 + "y", max_len=40)


def test_job_id_resolution_order_and_broadcast_hook() -> None:
    env = {"SYSX_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "te", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}
    assert resolve_job_id("explicit", env=env) == "explicit"
    assert resolve_job_id(env=env) == "mine"
    assert resolve_job_id(env={"TORCHELASTIC_RUN_ID": "8c7-f2"}) == "8c7_f2"
    assert resolve_job_id(env={"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}) == "77.2"
    assert resolve_job_id(env={"PBS_JOBID": "5.server"}) == "5.server"

    sent: list[str | None] = []
    shared: dict[str, str] = {}

    def broadcast(value: str | None) -> str:  # two "ranks" meeting in one process
        sent.append(value)
        if value is not None:
            shared["id"] = value
        return shared["id"]

    rank0 = resolve_job_id(env={}, rank=0, broadcast=broadcast)
    rank1 = resolve_job_id(env={}, rank=1, broadcast=broadcast)
    assert rank0 == rank1 and rank0.startswith("g")
    assert sent == [rank0, None]
    with pytest.raises(ValueError, match="broadcast"):
        resolve_job_id(env={}, rank=1)


def test_broadcast_hooks_for_torch_distributed_and_mpi() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job_id = resolve_job_id(env={}, rank=0, broadcast=names.torch_broadcast())
        assert job_id.startswith("g") and len(job_id) == 11
    finally:
        dist.destroy_process_group()

    class Comm:  # mpi4py's bcast: returns the root's object on every rank
        def __init__(self) -> None:
            self.root_value: object = None

        def bcast(self, value: object, root: int = 0) -> object:
            assert root == 0
            self.root_value = value
            return value

    comm = Comm()
    assert resolve_job_id(env={}, rank=0, broadcast=names.mpi_broadcast(comm)) == comm.root_value


# --- one segment --------------------------------------------------------------------------------
def test_segment_exact_size_mode_0600_and_header(job: str) -> None:
    old_umask = os.umask(0)
    try:
        seg = Segment.create(segment_name("p.a", job=job, node=0), 1000, meta={"k": 1})
    finally:
        os.umask(old_umask)
    st = os.stat(seg.name.path)
    assert st.st_mode & 0o777 == 0o600
    assert st.st_size == HEADER_BYTES + 1000  # exact: header page + payload, nothing rounded
    assert st.st_blocks * 512 >= st.st_size  # reserved up front (posix_fallocate)
    header = seg.header
    pid, started = procinfo.self_identity()
    assert (header.creator_pid, header.creator_start) == (pid, started)
    assert (header.layout_version, header.state, header.meta) == (LAYOUT_VERSION, STATE_READY, {"k": 1})
    assert _FIXED.unpack_from(os.pread(seg._fd, _FIXED.size, 0))[5:7] == (pid, started)  # watchdog's offset
    assert procinfo.lock_holders(st.st_dev, st.st_ino) == [pid]
    info = cleanup.inspect(seg.name.path)
    assert info is not None and info.status == "alive"
    seg.close()
    assert not _exists(seg.name)


def test_close_refuses_while_tensor_views_are_alive(job: str) -> None:
    seg = Segment.create(segment_name("p.a", job=job, node=0), 4096)
    t = seg.tensor(torch.float32, 0, 100)
    view = t[10:20].view(2, 5)  # derived views keep the mapping alive too
    del t
    with pytest.raises(LiveViewsError, match="still alive"):
        seg.close()
    assert _exists(seg.name) and not seg.closed
    view.fill_(3.0)  # still valid memory: no segfault
    assert float(view.sum()) == 30.0
    del view
    seg.close()
    assert seg.closed and not _exists(seg.name)


def test_attacher_sees_writes_and_owner_unlinks_only_after_detach(job: str) -> None:
    name = segment_name("p.a", job=job, node=0)
    owner = Segment.create(name, 4096)
    reader = Segment.attach(name, timeout_s=5)
    a, b = owner.tensor(torch.int32, 0, 16), reader.tensor(torch.int32, 0, 16)
    a.copy_(torch.arange(16, dtype=torch.int32))
    assert torch.equal(b, torch.arange(16, dtype=torch.int32))
    b[0] = 99
    assert int(a[0]) == 99
    with pytest.raises(SegmentError, match="only the owner"):
        reader.unlink()
    del a, b
    closer = threading.Thread(target=owner.close, kwargs={"timeout_s": 120})
    started = time.monotonic()
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive() and _exists(name)  # the owner waits for the attacher
    with pytest.raises(SegmentError, match="being closed"):
        Segment.attach(name, timeout_s=1)
    reader.close()
    closer.join(60)
    assert not closer.is_alive() and time.monotonic() - started < 60  # on the reader's close, not the 120 s timeout
    assert not _exists(name)


def test_owner_release_times_out_and_mappings_survive_unlink(job: str) -> None:
    name = segment_name("p.a", job=job, node=0)
    owner = Segment.create(name, 4096)
    reader = Segment.attach(name, timeout_s=5)
    with pytest.warns(RuntimeWarning, match="unlinking the name anyway"):
        assert owner.release(timeout_s=0.2) is False
    assert not _exists(name)
    view = reader.tensor(torch.float32, 0, 4)
    view.fill_(2.0)  # the attacher's mapping stays valid after unlink
    assert float(owner.tensor(torch.float32, 0, 4).sum()) == 8.0
    del view
    reader.close()
    owner.close()


def test_stale_segment_is_replaced_live_one_refused(job: str, sweeps_held: None) -> None:
    name = segment_name("p.a", job=job, node=0)
    _forge_stale(name)
    info = cleanup.inspect(name.path)
    assert info is not None and info.status == "stale" and info.holders == []
    with pytest.warns(RuntimeWarning, match="replacing stale"):
        seg = Segment.create(name, 8192)  # a restart with the same job id does not fail
    assert seg.data_bytes == 8192
    with pytest.raises(SegmentExistsError, match="already created by this process"):
        Segment.create(name, 8192)
    seg.close()


def test_attach_refuses_stale_but_not_a_segment_others_still_map(job: str, sweeps_held: None) -> None:
    import fcntl

    from sysx.memory.segment import StaleSegmentError

    name = segment_name("p.a", job=job, node=0)
    _forge_stale(name)
    with pytest.raises(StaleSegmentError, match="sysx shm clean"):
        Segment.attach(name, timeout_s=1)
    # another holder of the lock (e.g. the creator, alive in another pid namespace): attachable
    fd = os.open(name.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        seg = Segment.attach(name, timeout_s=1)
        assert cleanup.inspect(name.path).status == "orphaned"  # type: ignore[union-attr]
        seg.close()
    finally:
        os.close(fd)
    cleanup.remove(cleanup.inspect(name.path))  # type: ignore[arg-type]


def test_process_identity_detects_death_reuse_and_zombies() -> None:
    pid, started = procinfo.self_identity()
    assert procinfo.is_alive(pid, started)
    assert not procinfo.is_alive(pid, started + 1)  # same pid, other start time: reused
    assert not procinfo.is_alive(0, 0)
    child = subprocess.Popen(["sleep", "0"])
    child_start = procinfo.start_time(child.pid)
    deadline = time.monotonic() + 5
    while (procinfo._stat_fields(child.pid) or ["Z"])[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    if child_start is not None:
        assert not procinfo.is_alive(child.pid, child_start)  # exited, not yet reaped: zombie
    child.wait()
    assert procinfo.start_time(child.pid) is None or not procinfo.is_alive(child.pid, child_start or 0)


@pytest.mark.parametrize(
    ("has_header", "alive", "holders", "age", "error", "status"),
    [
        (True, True, [1], 100, None, "alive"),
        (True, False, [1], 100, None, "orphaned"),
        (True, False, [], 100, None, "stale"),
        (False, False, [], 1, None, "creating"),
        (False, False, [5], 100, None, "creating"),
        (False, False, [], 100, None, "broken"),
        (False, False, [], 1, "not a sysx segment", "broken"),
    ],
)
def test_classify(
    has_header: bool, alive: bool, holders: list[int], age: float, error: str | None, status: str
) -> None:
    header = object() if has_header else None
    assert cleanup.classify(header, alive, holders, age, error) == status  # type: ignore[arg-type]


# --- budgets ------------------------------------------------------------------------------------
def test_request_larger_than_free_shm_fails_before_allocating(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "shm_free_bytes", lambda path=names.SHM_DIR: MiB)

    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("a segment was opened although the budget check should have refused")

    monkeypatch.setattr("sysx.memory.segment.posix_ipc.SharedMemory", no_allocation)
    with pytest.raises(budget.ShmBudgetError) as err:
        Segment.create(segment_name("p.a", job=job, node=0), 4 * MiB)
    text = str(err.value)
    assert "4.0 MiB" in text and "1.0 MiB" in text and "nothing was allocated" in text
    assert "--shm-size=1g" in text and "emptyDir" in text and "medium: Memory" in text
    store = SharedParamStore(job=job, node=0, sweep=False)
    with pytest.raises(budget.ShmBudgetError, match="--shm-size"):
        store.create(StageSpec.of("s0", {torch.bfloat16: 3 * MiB}))
    assert not list(Path("/dev/shm").glob(f"sysx-*-{job}-*"))


def test_cgroup_limit_fails_before_allocating(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        budget, "cgroup_memory", lambda *a, **k: budget.CgroupMemory(2, "/sys/fs/cgroup/job", 3 * MiB, 2 * MiB)
    )
    with pytest.raises(budget.ShmBudgetError, match=r"(?s)cgroup memory limit leaves only 1.0 MiB.*--memory="):
        Segment.create(segment_name("p.a", job=job, node=0), 2 * MiB)


def test_fallocate_shortage_is_a_clear_error_and_leaves_nothing(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    name = segment_name("p.a", job=job, node=0)
    with pytest.raises(budget.ShmBudgetError, match=r"(?s)could not reserve .* No space left on device.*--shm-size"):
        Segment.create(name, MiB)
    assert not _exists(name)


def test_plan_host_memory_formulas() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    plan = budget.plan_host_memory([(1000, bf16), (3000, "bfloat16")], mirrors=[(500, bf16)], pinned_bytes=1 << 16)
    seg = lambda n: HEADER_BYTES + n  # noqa: E731 - one section: exact payload
    assert plan.shared == seg(2000) + seg(6000) + seg(1000)
    assert plan.master == 4000 * 4 and plan.optimizer == 4000 * 8 and plan.grads == 4000 * 4
    assert plan.total == plan.shared + 4000 * 16 + (1 << 16)
    assert plan.segments == 3
    fp32_plan = budget.plan_host_memory([{fp32: 1000}])
    assert fp32_plan.master == 0  # the fp32 shared copy is the master
    two = budget.plan_host_memory([{bf16: 100, fp32: 10}])
    assert two.shared == HEADER_BYTES + 256 + 40  # bf16 section padded to 256 bytes, then fp32
    assert "Adam m and v" in str(plan)


def test_plan_check_names_needed_available_and_fix() -> None:
    plan = budget.plan_host_memory([(100 * MiB, torch.bfloat16)])
    roomy = budget.HostCapacity(1 << 40, 1 << 40, 1 << 40, None)
    assert plan.check(roomy) is roomy
    small_shm = budget.HostCapacity(64 * 10**6, 64 * 10**6, 1 << 40, None)
    with pytest.raises(budget.ShmBudgetError) as err:
        plan.check(small_shm)
    assert "need 200.0 MiB, free 61.0 MiB" in str(err.value) and "docker run --shm-size=1g" in str(err.value)
    small_ram = budget.HostCapacity(1 << 40, 1 << 40, 512 * MiB, budget.CgroupMemory(2, "/cg", 1 << 30, 900 * MiB))
    with pytest.raises(budget.HostMemoryError) as err:
        plan.check(small_ram)
    text = str(err.value)
    assert "host RAM: need 1.8 GiB" in text and "available 512.0 MiB" in text
    assert "cgroup memory limit: need 1.8 GiB, available 124.0 MiB" in text and "--memory=" in text


def test_cgroup_memory_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(str(8 * MiB))
    (v2 / "job" / "memory.current").write_text(str(3 * MiB))
    (v2 / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {MiB}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (v2 / "job" / "step" / "memory.current").write_text("5\n")
    proc = tmp_path / "cgroup_v2"
    proc.write_text("0::/job/step\n")
    found = budget.cgroup_memory(str(proc), str(v2))
    assert found is not None and (found.version, found.limit, found.available) == (2, 8 * MiB, 6 * MiB)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(4 * MiB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(MiB))
    proc1 = tmp_path / "cgroup_v1"
    proc1.write_text("9:name=systemd:/\n4:memory:/in/another/namespace\n0::/\n")
    found = budget.cgroup_memory(str(proc1), str(v1))
    assert found is not None and (found.version, found.available) == (1, 3 * MiB)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert budget.cgroup_memory(str(proc1), str(v1)) is None  # unlimited


def test_remove_ipc_warning(tmp_path: Path) -> None:
    conf = tmp_path / "logind.conf"
    dropins = tmp_path / "logind.conf.d"
    kw = {"conf": str(conf), "dropin_dirs": (str(dropins),)}
    assert budget.remove_ipc_warning(uid=1000, **kw) is None  # no systemd config at all
    conf.write_text("[Login]\n#RemoveIPC=yes\n")
    text = budget.remove_ipc_warning(uid=1000, **kw)
    assert text is not None and "RemoveIPC=yes" in text and "RemoveIPC=no" in text and "enable-linger" in text
    assert budget.remove_ipc_warning(uid=0, **kw) is None  # root and system users are exempt
    dropins.mkdir()
    (dropins / "10-sysx.conf").write_text("[Login]\nRemoveIPC=no\n")
    assert budget.remove_ipc_warning(uid=1000, **kw) is None


# --- pinned staging -----------------------------------------------------------------------------
class _FakeCudart:
    def __init__(self, code: int, staging: list[pinned.PinnedStaging]) -> None:
        self.code = code
        self.calls: list[tuple[str, int, bool]] = []
        self._staging = staging

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, flags == pinned.CUDA_HOST_REGISTER_PORTABLE))
        return self.code

    def cudaHostUnregister(self, address: int) -> int:
        mapped = bool(self._staging) and not self._staging[0].closed
        self.calls.append(("unregister", address, mapped))
        return 0

    def cudaError(self, code: int) -> int:
        return code

    def cudaGetErrorString(self, code: int) -> str:
        return f"fake error {code}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_pinned_staging_is_a_silent_noop_on_cpu() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        staging = pinned.PinnedStaging(MiB)
    assert (staging.pinned, staging.mode) == (False, "cpu")
    view = staging.view(torch.float32, 1000)
    view.fill_(1.0)
    assert staging.view(torch.float32, 1000).sum() == 1000  # the same memory, reused
    with pytest.raises(ValueError, match="outside"):
        staging.view(torch.float32, MiB)
    with pytest.raises(LiveViewsError):
        staging.close()
    del view
    staging.close()
    assert staging.closed


@pytest.mark.parametrize(("code", "mode"), [(0, "registered"), (2, "pageable"), (712, "registered")])
def test_pinned_registration_paths(code: int, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA logic with a fake cudart (the CPU twin of the gpu test below)."""
    made: list[pinned.PinnedStaging] = []
    fake = _FakeCudart(code, made)
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    if code == 2:
        with pytest.warns(RuntimeWarning, match="(?s)FALLING BACK TO PAGEABLE MEMORY.*memlock"):
            staging = pinned.PinnedStaging(3 * 4096 + 5)
    else:
        staging = pinned.PinnedStaging(3 * 4096 + 5)
    made.append(staging)
    assert staging.mode == mode and staging.pinned == (code != 2)
    assert fake.calls == [("register", staging.address, True)]
    staging.close()
    if code == 0:  # unregistered while still mapped, exactly once
        assert fake.calls[1:] == [("unregister", staging.address, True)]
    else:  # failed, or registered by someone else: not ours to unregister
        assert fake.calls[1:] == []


def test_host_buffers_register_exact_sizes_or_stay_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's and the pipeline's host buffers: exact-size registrations with CUDA (no power-of-two
    rounding), unregistered on close; plain torch.empty tensors without CUDA."""
    monkeypatch.setattr(pinned, "_cuda_available", lambda: False)
    plain = pinned.HostBuffers("test", pin=True).empty(10, torch.bfloat16)
    assert plain.numel() == 10 and plain.dtype == torch.bfloat16 and not plain.is_pinned()
    fake = _FakeCudart(0, [])
    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    buffers = pinned.HostBuffers("test")
    t = buffers.empty(3 * 4096 + 5, torch.bfloat16)
    assert t.numel() == 3 * 4096 + 5 and buffers.pinned_bytes == 2 * (3 * 4096 + 5)
    assert [c[0] for c in fake.calls] == ["register"]
    buffers.close()  # still viewed: stays mapped and registered
    assert [c[0] for c in fake.calls] == ["register"]
    del t
    buffers.close()
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and buffers.pinned_bytes == 0


@pytest.mark.gpu
def test_pinned_staging_and_store_register_on_gpu(job: str) -> None:
    staging = pinned.PinnedStaging(MiB)
    assert staging.pinned and staging.mode == "registered"
    host = staging.view(torch.float32, 1024)
    host.copy_(torch.arange(1024, dtype=torch.float32))
    device = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host)
    del host
    staging.close()
    with SharedParamStore(job=job, node=0) as store:
        stage = store.create(StageSpec.of("s0", {torch.bfloat16: 4096}))
        assert stage.pinned
        stage.flat.fill_(1.5)
        assert float(stage.flat.to("cuda", non_blocking=True).sum()) == 1.5 * 4096
        del stage


# --- the store ----------------------------------------------------------------------------------
def test_store_owned_and_mirror_segments_and_push(job: str) -> None:
    spec = StageSpec.of("s1.0", {torch.bfloat16: 1000, torch.float32: 10}, owner_node=0, mirror_nodes=[1])
    local = StageSpec.of("s0.0", {torch.bfloat16: 64}, owner_node=0)
    node0, node1 = SharedParamStore(job=job, node=0), SharedParamStore(job=job, node=1)
    owned, mirror, other = node0.create(spec), node1.create(spec), node0.create(local)
    assert [s.key for s in node0.owned()] == ["s1.0", "s0.0"] and node0.mirrors() == []
    assert [s.key for s in node1.mirrors()] == ["s1.0"] and node1.owned() == []
    for stage in (owned, mirror):
        for section in spec.layout():
            t = stage[section.dtype]
            assert t.is_contiguous() and t.dim() == 1 and t.numel() == section.numel
            assert t.data_ptr() == stage.segment.data_address + section.byte_offset  # the mapping itself
    assert os.stat(owned.segment.name.path).st_size == HEADER_BYTES + spec.data_bytes
    owned[torch.bfloat16].copy_(torch.linspace(-1, 1, 1000, dtype=torch.bfloat16))
    owned[torch.float32].fill_(0.25)
    pushes = node0.mirror_pushes()
    assert [(p.key, p.dst_node, p.dst_segment, p.dtype) for p in pushes] == [
        ("s1.0", 1, f"/sysx-{names.current_user()}-{job}-1-p.s1.0", torch.bfloat16),
        ("s1.0", 1, f"/sysx-{names.current_user()}-{job}-1-p.s1.0", torch.float32),
    ]
    results = node0.push_to_mirrors(lambda p: node1.get(p.key)[p.dtype].copy_(p.tensor).numel())
    assert results == [1000, 10]
    assert torch.equal(mirror[torch.bfloat16], owned[torch.bfloat16]) and float(mirror[torch.float32][3]) == 0.25
    with pytest.raises(ValueError, match="only the owner node pushes"):
        node1.mirror_pushes(["s1.0"])
    reader = SharedParamStore(job=job, node=0, sweep=False)
    with pytest.raises(ValueError, match="same partition"):
        reader.attach(StageSpec.of("s1.0", {torch.bfloat16: 999, torch.float32: 10}, mirror_nodes=[1]), timeout_s=2)
    attached = reader.attach("s1.0", timeout_s=2)
    assert attached.role == "owned" and not attached.created_here and attached.spec == spec
    assert torch.equal(attached[torch.bfloat16], owned[torch.bfloat16])
    del owned, mirror, other, attached, t, pushes
    reader.close()
    node1.close()
    node0.close()


def test_store_close_refuses_live_views_then_succeeds(job: str) -> None:
    store = SharedParamStore(job=job, node=0)
    stage = store.create(StageSpec.of("s0", {torch.float32: 256}))
    param = stage.flat[:16].view(4, 4)
    del stage
    with pytest.raises(LiveViewsError, match=r"\['s0'\]"):
        store.close()
    assert "s0" in store and float(param.sum()) == 0.0
    del param
    store.close()
    assert "s0" not in store


def test_store_start_sweeps_stale_segments(job: str, sweeps_held: None) -> None:
    _forge_stale(segment_name("p.old", job=job, node=0))
    with pytest.warns(RuntimeWarning, match="removed 1 stale shared-memory segment"):
        SharedParamStore(job=job, node=0)
    assert cleanup.scan(job=job) == []


def test_stage_spec_validation() -> None:
    with pytest.raises(ValueError, match="must match"):
        StageSpec.of("a-b", {torch.float32: 1})
    with pytest.raises(ValueError, match="cannot also be a mirror"):
        StageSpec.of("a", {torch.float32: 1}, owner_node=1, mirror_nodes=[1])
    with pytest.raises(ValueError, match="node 2 holds no copy"):
        StageSpec.of("a", {torch.float32: 1}, owner_node=0, mirror_nodes=[1]).role_on(2)
    with pytest.raises(ValueError, match="positive"):
        StageSpec.of("a", {torch.float32: 0})


# --- exit paths inside this process -------------------------------------------------------------
def test_sigterm_handler_unlinks_then_chains_to_previous_handler(job: str) -> None:
    original = signal.getsignal(signal.SIGTERM)
    cleanup.uninstall_signal_handlers()
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        seg = Segment.create(segment_name("p.a", job=job, node=0), 4096)  # installs the handler
        assert signal.getsignal(signal.SIGTERM) is cleanup._on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]  # the previous handler still ran
        assert not _exists(seg.name) and seg.unlinked  # after our cleanup
        seg.close()
    finally:
        cleanup.uninstall_signal_handlers()
        signal.signal(signal.SIGTERM, original)


def test_forked_child_never_unlinks_parent_segments(job: str) -> None:
    seg = Segment.create(segment_name("p.a", job=job, node=0), 4096)
    pid = os.fork()
    if pid == 0:  # child: inherited nothing to clean up
        code = 0 if not cleanup.owned_segments() else 3
        cleanup.release_all(timeout_s=0)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _exists(seg.name)
    seg.close()


# --- the command line ---------------------------------------------------------------------------
def test_cli_list_clean_and_clean_all(job: str, sweeps_held: None, capsys: pytest.CaptureFixture[str]) -> None:
    live = Segment.create(segment_name("p.live", job=job, node=0), 4096)
    stale = segment_name("p.dead", job=job, node=1)
    _forge_stale(stale, 2 * MiB)
    assert shm_main(["list", "--job", job]) == 0
    out = capsys.readouterr().out
    assert "NAME" in out and "STATUS" in out
    assert any(live.name.name in line and line.rstrip().endswith("alive") for line in out.splitlines())
    assert any(
        stale.name in line and "2.0 MiB" in line and line.rstrip().endswith("stale") for line in out.splitlines()
    )
    assert shm_main(["clean", "--job", job]) == 0
    out = capsys.readouterr().out
    assert f"removed {stale.name}" in out and live.name.name not in out
    assert not _exists(stale) and _exists(live.name)
    assert shm_main(["clean", "--all", "--job", job]) == 0  # stdin is not a TTY: no question asked
    out = capsys.readouterr().out
    assert f"removed {live.name.name}" in out and not _exists(live.name)
    live.close()  # the name is gone already: the owner's unlink is skipped, not an error
    assert shm_main(["list", "--job", job]) == 0
    assert "no sysx shared-memory segments" in capsys.readouterr().out


def test_cli_clean_all_asks_on_a_terminal(
    job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = Segment.create(segment_name("p.live", job=job, node=0), 4096)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert shm_main(["clean", "--all", "--job", job]) == 1
    out = capsys.readouterr().out
    assert "in use by running processes" in out and "nothing removed" in out and _exists(seg.name)
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert shm_main(["clean", "--all", "--job", job]) == 0
    assert not _exists(seg.name)
    seg.close()


def test_a_launchers_leftover_segment_goes_once_nobody_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MPICH's ``mpich_shm_*`` of a killed ``mpirun`` is removed by ``sysx shm clean`` (and a job's
    start sweep); one a live process maps or holds open, a young one, and other files stay."""
    from sysx.memory import launcher_shm

    old = time.time() - 2 * launcher_shm.GRACE_S
    for name in ("mpich_shm_dead_0", "mpich_shm_mapped_0", "mpich_shm_open_0", "mpich_shm_young_0", "other_old"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "mpich_shm_young_0":
            os.utime(tmp_path / name, (old, old))
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            "import mmap, sys, time\n"
            f"g = open({str(tmp_path / 'mpich_shm_mapped_0')!r}, 'r+b')\n"
            "m = mmap.mmap(g.fileno(), 4096)\ng.close()  # mapped, no longer open\n"
            f"f = open({str(tmp_path / 'mpich_shm_open_0')!r}, 'rb')\n"
            "print('ready', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        left = launcher_shm.launcher_leftovers(str(tmp_path))
        assert [Path(x.path).name for x in left] == ["mpich_shm_dead_0"]
        monkeypatch.setattr(launcher_shm, "SHM_DIR", str(tmp_path))
        monkeypatch.setattr("sysx.memory.cli.scan", lambda job=None: [])  # leave other tests' sysx segments alone
        assert shm_main(["list"]) == 0
        assert "1 segment(s) a killed launcher left" in capsys.readouterr().out
        assert shm_main(["clean"]) == 0
        assert f"removed {tmp_path / 'mpich_shm_dead_0'}" in capsys.readouterr().out
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "mpich_shm_mapped_0",
            "mpich_shm_open_0",
            "mpich_shm_young_0",
            "other_old",
        ]
    finally:
        holder.kill()
        holder.wait()
    assert [Path(x.path).name for x in launcher_shm.sweep_launcher_leftovers(str(tmp_path))] == [
        "mpich_shm_mapped_0",
        "mpich_shm_open_0",
    ]
