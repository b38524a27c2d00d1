"""A tiny watcher process that unlinks a process's owned segments (and removes its scratch
directories, e.g. the NVMe tier's state directories) if that process dies abruptly.

SIGKILL runs no Python code, so neither atexit nor signal handlers can clean up; the guardian
(``_watchdog.py``) is a child that notices when its parent is gone and unlinks the segments the
parent still owned. Disable with ``SYSX_SHM_GUARDIAN=0``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

from sysx.memory import procinfo
from sysx.memory.names import SHM_DIR

_WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog.py")


def enabled() -> bool:
    """False when ``SYSX_SHM_GUARDIAN`` is ``0``/``false``/``no``/``off``."""
    return os.environ.get("SYSX_SHM_GUARDIAN", "1").strip().lower() not in ("0", "false", "no", "off")


class Guardian:
    """The parent-side handle of the watcher process (one per process, started lazily)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.broken = False

    def _ensure(self) -> subprocess.Popen[str] | None:
        if self._proc is not None and self._pid == os.getpid():
            return self._proc
        pid, started = procinfo.self_identity()
        self._pid = pid
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _WATCHDOG, str(pid), str(started), SHM_DIR],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
            close_fds=True,
        )
        return self._proc

    def _send(self, line: str) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                proc = self._ensure()
                assert proc is not None and proc.stdin is not None
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (OSError, ValueError) as exc:
                self.broken = True
                sys.stderr.write(
                    f"sysx: the shared-memory guardian process is gone ({exc}); segments of this process will leak "
                    "if it is SIGKILLed (`sysx shm clean` removes them)\n"
                )

    def track(self, name: str, inode: int) -> None:
        """Unlink ``name`` (if still inode ``inode`` and still ours) should this process die."""
        self._send(f"+ {name} {inode}")

    def untrack(self, name: str) -> None:
        """This process released ``name`` itself: forget it."""
        if self._proc is not None and self._pid == os.getpid():
            self._send(f"- {name}")

    def track_dir(self, path: str, inode: int) -> None:
        """Remove directory ``path`` (if still inode ``inode`` and its ``owner.json`` names this
        process) should this process die."""
        self._send(f"d+ {path} {inode}")

    def untrack_dir(self, path: str) -> None:
        """This process removed ``path`` itself: forget it."""
        if self._proc is not None and self._pid == os.getpid():
            self._send(f"d- {path}")

    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited handle (the child owns nothing)."""
        if self._proc is not None:
            _inherited.append(self._proc)  # keep it referenced: no __del__ games in the child
            with contextlib.suppress(OSError, ValueError):
                if self._proc.stdin is not None:
                    self._proc.stdin.close()  # the child's copy of the write end only
        self._proc = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """At exit, after releasing: close the pipe (the watcher removes anything still listed and
        exits) and reap it."""
        proc = self._proc
        if proc is None or self._pid != os.getpid():
            return
        self._proc = None
        with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout_s)

    @property
    def pid(self) -> int | None:
        """The watcher's pid once started."""
        return self._proc.pid if self._proc is not None else None


_inherited: list[subprocess.Popen[str]] = []
GUARDIAN = Guardian()
