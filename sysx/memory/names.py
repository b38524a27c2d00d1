"""Shared-memory segment names and the job id they carry.

Every segment sysx creates is named ``/sysx-<user>-<job>-<node>-<what>`` and shows up as
``/dev/shm/sysx-<user>-<job>-<node>-<what>``. The four parts never contain ``-`` (user and job
are sanitized, node and what are validated), so a name parses back into its parts unambiguously.

The job id comes from, in order: an explicit value, ``SYSX_JOB_ID``, ``TORCHELASTIC_RUN_ID``
(torchrun), ``SLURM_JOB_ID`` (+ ``SLURM_STEP_ID``), ``PBS_JOBID``, ``LSB_JOBID``; otherwise rank 0
generates one and a broadcast hook hands it to every rank. The hook is a plain callable so this
module does not depend on any process-group code (helpers for torch.distributed and mpi4py below).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "sysx"
SHM_DIR = "/dev/shm"
MAX_NAME_LEN = 250  # NAME_MAX is 255 on Linux tmpfs
_PART_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_MAX_USER = 32
_MAX_JOB = 40

#: ``broadcast(value_on_rank0_or_None) -> rank 0's value`` on every rank.
BroadcastFn = Callable[[str | None], str]

#: Environment variables tried for a job id, in order (launcher-given ids).
JOB_ID_ENV = ("SYSX_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def sanitize(part: str, *, max_len: int) -> str:
    """Make ``part`` safe as one name component: characters outside ``[A-Za-z0-9_.]`` become
    ``_``; a value longer than ``max_len`` is shortened with a hash suffix (deterministic, so every
    rank computes the same name)."""
    clean = re.sub(r"[^A-Za-z0-9_.]", "_", part)
    if not clean:
        raise ValueError(f"empty name component from {part!r}")
    if len(clean) > max_len:
        digest = hashlib.sha1(part.encode()).hexdigest()[:8]
        clean = f"{clean[: max_len - 9]}_{digest}"
    return clean


def current_user() -> str:
    """This process's user name (sanitized), or ``uid<N>`` when the uid has no passwd entry."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid{uid}"
    return sanitize(name, max_len=_MAX_USER)


@dataclass(frozen=True)
class SegmentName:
    """The parts of a sysx segment name."""

    user: str
    job: str
    node: str
    what: str

    def __post_init__(self) -> None:
        for field, value in (("user", self.user), ("job", self.job), ("node", self.node), ("what", self.what)):
            if not _PART_RE.match(value):
                raise ValueError(
                    f"segment name part {field}={value!r} must match [A-Za-z0-9_.]+ "
                    "(no '-', '/', spaces); sanitize it with sysx.memory.names.sanitize"
                )
        if len(self.name) > MAX_NAME_LEN:
            raise ValueError(f"segment name {self.name!r} is {len(self.name)} characters; the limit is {MAX_NAME_LEN}")

    @property
    def name(self) -> str:
        """The POSIX name, with the leading slash: ``/sysx-user-job-node-what``."""
        return f"/{PREFIX}-{self.user}-{self.job}-{self.node}-{self.what}"

    @property
    def path(self) -> str:
        """Where the segment appears in the file system."""
        return os.path.join(SHM_DIR, self.name.lstrip("/"))

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        """Split a segment name (with or without the leading ``/``); None if it is not a sysx name."""
        parts = name.lstrip("/").split("-")
        if len(parts) != 5 or parts[0] != PREFIX:
            return None
        try:
            return cls(*parts[1:])
        except ValueError:
            return None


def segment_name(what: str, *, job: str, node: int | str, user: str | None = None) -> SegmentName:
    """The name of segment ``what`` of ``job`` on ``node`` for ``user`` (default: this user)."""
    return SegmentName(
        user=current_user() if user is None else sanitize(user, max_len=_MAX_USER),
        job=sanitize(job, max_len=_MAX_JOB),
        node=sanitize(str(node), max_len=16),
        what=what,
    )


def user_entries(directory: str, *, user: str | None = None, job: str | None = None) -> list[tuple[str, SegmentName]]:
    """``(path, parsed name)`` of every entry of ``directory`` named like a sysx segment of ``user``
    (default: this user), sorted by name; ``job`` narrows to one job id. Shared by the segment scan
    and the NVMe state-directory scan. An absent directory has none."""
    user = current_user() if user is None else user
    job = None if job is None else sanitize(job, max_len=_MAX_JOB)
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        parsed = SegmentName.parse(entry)
        mine = entry.startswith(PREFIX + "-") and parsed is not None and parsed.user == user
        if mine and parsed is not None and (job is None or parsed.job == job):
            found.append((os.path.join(directory, entry), parsed))
    return found


def job_id_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The launcher's job id, or None when the environment has none.

    torchrun's default rendezvous id ``none`` is ignored (two jobs would share it).
    """
    env = os.environ if env is None else env
    for key in JOB_ID_ENV:
        value = env.get(key, "").strip()
        if not value or (key == "TORCHELASTIC_RUN_ID" and value.lower() == "none"):
            continue
        if key == "SLURM_JOB_ID" and env.get("SLURM_STEP_ID", "").strip():
            value = f"{value}.{env['SLURM_STEP_ID'].strip()}"
        return sanitize(value, max_len=_MAX_JOB)
    return None


def generate_job_id() -> str:
    """A fresh random job id (``g`` + 10 hex digits)."""
    return f"g{secrets.token_hex(5)}"


def resolve_job_id(
    explicit: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    rank: int = 0,
    broadcast: BroadcastFn | None = None,
) -> str:
    """The job id every rank of the job agrees on.

    ``explicit`` wins, then the launcher's environment (:func:`job_id_from_env`). Otherwise rank 0
    generates an id and ``broadcast`` gives it to every rank; without ``broadcast`` the process is
    assumed to be alone and uses its own generated id.
    """
    if explicit is not None:
        return sanitize(str(explicit), max_len=_MAX_JOB)
    found = job_id_from_env(env)
    if found is not None:
        return found
    if broadcast is None:
        if rank != 0:
            raise ValueError(
                f"rank {rank}: no job id in the environment ({', '.join(JOB_ID_ENV)}) and no broadcast hook; "
                "pass job_id=... or broadcast=torch_broadcast(group) / mpi_broadcast(comm)"
            )
        return generate_job_id()
    value = broadcast(generate_job_id() if rank == 0 else None)
    if not isinstance(value, str) or not value:
        raise ValueError(f"the broadcast hook returned {value!r}; it must return rank 0's job id string")
    return sanitize(value, max_len=_MAX_JOB)


def torch_broadcast(group: Any = None) -> BroadcastFn:
    """A broadcast hook over a ``torch.distributed`` group (default: the world); source is the
    group's rank 0."""

    def _broadcast(value: str | None) -> str:
        import torch.distributed as dist

        src = 0 if group is None else dist.get_global_rank(group, 0)
        box = [value]
        dist.broadcast_object_list(box, src=src, group=group)
        return str(box[0])

    return _broadcast


def mpi_broadcast(comm: Any) -> BroadcastFn:
    """A broadcast hook over an mpi4py communicator (source: its rank 0)."""

    def _broadcast(value: str | None) -> str:
        return str(comm.bcast(value, root=0))

    return _broadcast
