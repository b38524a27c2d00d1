"""Per-rank host memory beside the plan, for `tiny2_layouts.sh` (issue 27, point 3; not part of sysx).

Loaded by every process whose PYTHONPATH starts with this folder, active with ``SYSX_MEMPROBE=1``.
At the prediction check each rank prints ``MEMPROBE``: its growth as the check counts it
(:func:`sysx.trainers.prediction.host_growth`) and what glibc's ``mallinfo2`` says changed since the
baseline (the main heap's size, the bytes in use and free in it, the bytes in mmapped blocks);
rank 0 prints ``PLANPROBE``: the simulated plan's per-rank terms (optimizer state and the process's
fixed bytes; the device peak and its parameter, gradient, checkpoint and work categories; the
node's shared copy).
"""

import ctypes
import os

if os.environ.get("SYSX_MEMPROBE"):
    import sysx.trainers.prediction as P
    from sysx.schedule.simulate import simulate

    # glibc's struct mallinfo2, in order
    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in FIELDS]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    MIB = 2**20
    start0, growth0, predict0 = P.start_host_peak, P.host_growth, P.predict
    at_base: list[MallInfo2] = []

    def start_host_peak(*args):
        base = start0(*args)
        at_base.append(libc.mallinfo2())
        return base

    def host_growth(base):
        grown, now, was = growth0(base), libc.mallinfo2(), at_base[-1]
        print(
            f"MEMPROBE rank {os.environ.get('RANK', '?')} growth {grown / MIB:.1f} MiB heap {(now.arena - was.arena) / MIB:+.1f} "
            f"inuse {(now.uordblks - was.uordblks) / MIB:+.1f} free {(now.fordblks - was.fordblks) / MIB:+.1f} "
            f"(now {now.fordblks / MIB:.1f}) mmapped {(now.hblkhd - was.hblkhd) / MIB:+.1f}",
            flush=True,
        )
        return grown

    def predict(schedule, costs, **kw):
        table = costs.table(schedule) if hasattr(costs, "table") else costs
        tl = simulate(schedule, table, record=False, gpus_per_node=kw.get("gpus_per_node"))

        def mib(xs):
            return [round(x / MIB, 2) for x in xs]

        print(
            f"PLANPROBE replicas {tl.replicas} host {mib(tl.host)} peak_dev {mib(tl.peak_gpu)} params {mib(tl.peak_params)} "
            f"grads {mib(tl.peak_grads)} ckpts {mib(tl.peak_ckpts)} work {mib(tl.peak_work)} shm {mib(tl.shm)} "
            f"process_bytes {table.process_bytes / MIB:.2f}",
            flush=True,
        )
        return predict0(schedule, costs, **kw)

    P.start_host_peak, P.host_growth, P.predict = start_host_peak, host_growth, predict
