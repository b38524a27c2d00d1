import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29675")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # 1) a delayed partner: rank 0 waits in 0.1 s slices
    if rank == 1:
        time.sleep(0.35)
    t = torch.ones(1) * (rank + 1)
    w = dist.all_reduce(t, async_op=True)
    t0 = time.perf_counter()
    tries = 0
    while True:
        try:
            ok = w.wait(datetime.timedelta(milliseconds=100))
            break
        except RuntimeError as e:
            tries += 1
            if tries == 1 and rank == 0:
                print("timeout message:", str(e).splitlines()[0][:150], "completed:", w.is_completed(), flush=True)
    print(rank, "ok", ok, "value", t.item(), "tries", tries, "waited %.3f" % (time.perf_counter() - t0), flush=True)
    # 2) latency of a blocking wait vs polling, 200 all-reduces back to back
    for mode in ("block", "poll"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            w = dist.all_reduce(torch.ones(1), async_op=True)
            if mode == "block":
                w.wait(datetime.timedelta(milliseconds=100))
            else:
                p = 5e-5
                while not w.is_completed():
                    time.sleep(p)
                    p = min(2 * p, 1e-3)
                w.wait()
        if rank == 0:
            print(mode, "us per all-reduce %.1f" % ((time.perf_counter() - t0) / 200 * 1e6), flush=True)
    # 3) a dead partner
    if rank == 1:
        os._exit(0)
    w = dist.all_reduce(torch.ones(1), async_op=True)
    t0 = time.perf_counter()
    for _i in range(50):
        try:
            w.wait(datetime.timedelta(milliseconds=100))
            print("returned?")
            break
        except RuntimeError as e:
            if w.is_completed():
                print(
                    "dead peer after %.3f s: completed=True:" % (time.perf_counter() - t0),
                    str(e).splitlines()[0][:150],
                    flush=True,
                )
                break
    else:
        print("dead peer: still not completed after 5 s", flush=True)
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2, join=False).join() if False else None
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=main, args=(r, 2)) for r in (0, 1)]
    [p.start() for p in ps]
    [p.join(30) for p in ps]
