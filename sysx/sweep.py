"""``sysx-train -m``: a Hydra-style sweep of single-process jobs.

Every point is composed and validated before the first starts; then the points run one after
another, each in its own process (a crash or a refusal of one leaves the others running) and in
its own run directory, ``<run_dir>/<n>`` as Hydra's ``multirun/<time>/<n>``. One summary line per
point ends the sweep; the exit status is 0 when every point succeeded. A signal stops the point
running (it stops as a job does) and the sweep.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from sysx.config import ConfigError, load_config
from sysx.rank_env import env_world_size

PROG = "sysx-train"


def plan_sweep(points: list[list[str]]) -> list[list[str]]:
    """Each point's overrides with its run directory: ``<run_dir>/<n>`` unless ``run_dir`` is swept.
    Every point is validated first; a shared ``checkpoint.dir`` (every point would resume the
    others' checkpoints) is refused."""
    world = env_world_size()
    if world > 1:
        raise ConfigError(
            f"-m (a sweep) runs one single-process job per point, not under a launcher (WORLD_SIZE={world}); "
            "start one launcher job per point instead"
        )
    configs = []
    for n, point in enumerate(points):
        try:
            configs.append(load_config(point))
        except ConfigError as err:
            raise ConfigError(f"sweep point {n} ({' '.join(point)}): {err}") from None
    swept_run_dir = len({tuple(o for o in point if o.lstrip("+").startswith("run_dir=")) for point in points}) > 1
    dirs = {cfg.checkpoint.dir for cfg in configs}
    if len(points) > 1 and None not in dirs and len(dirs) < len(points):
        raise ConfigError(
            f"checkpoint.dir={configs[0].checkpoint.dir} is shared by the sweep's points, which would resume "
            "each other's checkpoints; remove it (each point saves into its <run_dir>/checkpoints)"
        )
    if swept_run_dir:
        return [list(point) for point in points]
    base = configs[0].run_dir  # resolved once: every point shares the timestamp of the default
    return [
        [*(o for o in point if not o.lstrip("+").startswith("run_dir=")), f"run_dir={Path(base) / str(n)}"]
        for n, point in enumerate(points)
    ]


def run_sweep(points: list[list[str]], flags: list[str]) -> int:
    """Run the planned points one after another (``python -m sysx.train <flags> <point>``); returns
    0 when all succeeded, the stop's status after a signal, else 1."""
    planned = plan_sweep(points)
    running: list[subprocess.Popen[bytes]] = []
    stopped: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:  # the point stops as a job does; then the sweep
        stopped.append(signum)
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    results: list[tuple[list[str], int]] = []
    common = set.intersection(*(set(point) for point in planned))
    try:
        for n, point in enumerate(planned):
            print(f"{PROG}: sweep point {n} of {len(planned)}: {' '.join(point)}", flush=True)
            running[:] = [subprocess.Popen([sys.executable, "-m", "sysx.train", *flags, *point])]
            results.append((point, running[0].wait()))
            if stopped:
                break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for n, (point, rc) in enumerate(results):
        outcome = "ok" if rc == 0 else f"{'stopped' if stopped and n == len(results) - 1 else 'failed'} (exit {rc})"
        print(f"{PROG}: sweep point {n}: {outcome}: {' '.join(o for o in point if o not in common)}", flush=True)
    if stopped:
        print(f"{PROG}: sweep stopped after {len(results)} of {len(planned)} points", file=sys.stderr, flush=True)
        return 128 + stopped[0]
    failed = sum(rc != 0 for _, rc in results)
    if failed:
        print(f"{PROG}: sweep: {failed} of {len(planned)} points failed", file=sys.stderr, flush=True)
    return 1 if failed else 0
