"""A probe, not sysx code: glibc's heap (``mallinfo2``) and the RSS after every block pass of a
``schedule=single`` job, to see where the window's host memory goes with kept graphs and with saved
sites. Put this folder on ``PYTHONPATH`` and set ``SYSX_MI=1``:

    SYSX_MI=1 OMP_NUM_THREADS=1 PYTHONPATH=.:profiling/results/cpu_2026-11-26_seventh \\
        .venv/bin/python -m sysx.train schedule=single model=tiny train.seq_len=128 device=cpu \\
        optim.backend=torch eval.every=0 train.steps=3 single.keep_graph=true

It prints the row with the largest RSS and the first ten rows: (pass, heap, in use, free, mmapped,
RSS), MiB.
"""

import atexit
import ctypes
import os
from pathlib import Path

if os.environ.get("SYSX_MI"):

    class _MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2

    import sysx.single.executor as _executor

    _rows: list[tuple[str, int, int, int, int, int]] = []

    def _snap(tag: str) -> None:
        m = _libc.mallinfo2()
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        _rows.append((tag, m.arena >> 20, m.uordblks >> 20, m.fordblks >> 20, m.hblkhd >> 20, rss >> 20))

    for _name in ("run_keeping_graph", "backward_kept", "run_captured", "backward_replayed"):
        _fn = getattr(_executor, _name)

        def _probed(*args, _fn=_fn, _name=_name, **kwargs):
            out = _fn(*args, **kwargs)
            _snap(_name)
            return out

        setattr(_executor, _name, _probed)

    @atexit.register
    def _dump() -> None:
        if _rows:
            print("MI peak RSS row (pass, heap, in use, free, mmapped, RSS MiB):", max(_rows, key=lambda r: r[5]))
        for row in _rows[:10]:
            print("MI", row)
