"""Host costs no layer time contains: the fixed Python cost of one executor instruction, and the
resident memory a training process adds besides its training state (issue 27, point 3).

:func:`measure_op_host_s` times what every instruction of an op list pays whatever it does: a
handler looked up and called, a small tensor made and copied, a clock read for the op's record,
a dict entry kept and popped (the executor's stores). The layer compute of a pass is priced by the
profile's layer times, which include the module's own Python overhead; this is what is left.
:func:`measure_process_bytes` starts one fresh process that imports torch and sysx, opens a
one-rank gloo group, then runs one small Block forward and backward and one Adam step on a worker
thread, and reports how much its anonymous memory grew past the point where a rank's plan starts
counting (autograd's and the allocator's caches, thread stacks and arenas), as the prediction
check counts a rank's memory (:func:`sysx.trainers.prediction.host_growth`: file pages, such as
the kernels loaded lazily, are page cache and left out on both sides). :func:`measure_backward_bytes`
measures, in another fresh process, what the backward of the job's Block holds at its peak at
each token count, its parameters and gradients made before the count starts: the plan charges a
layer's activations for it, the process needs more (autograd's saved tensors and the gradient
temporaries, and what glibc keeps of the freed workspace in its heap).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sysx import device as dev
from sysx.schedule.ops import Op, OpKind

log = logging.getLogger("sysx.machine")

OPS_PER_ROUND = 200  # instructions per timed round: enough to amortise the loop's own cost
PROCESS_TIMEOUT_S = 120.0


def _instruction_round(n: int) -> Callable[[], None]:
    """One round of ``n`` minimal instructions, shaped like the executor's dispatch loop: the op
    timer, a handler per op kind, the op's label, a no-grad context, a small tensor made, copied,
    kept and popped."""
    src = torch.zeros(4)
    store: dict[tuple[int, int], torch.Tensor] = {}
    ops = [Op(kind, stage=i % 3, sub=i % 2, mb=i % 4, peer=1) for i, kind in enumerate(OpKind)]

    def handler(op: Op) -> None:
        label = str(op)
        with torch.no_grad():
            out = torch.empty_like(src)
            out.copy_(src)
        store[(op.stage, op.mb)] = out
        store.pop((op.stage, op.mb))
        if not label:
            raise AssertionError("an op without a label")

    handlers = {op.kind: handler for op in ops}

    def run() -> None:
        timer = dev.OpTimer("cpu")
        for i in range(n):
            op = ops[i % len(ops)]
            started = timer.start()
            handlers[op.kind](op)
            timer.stop(op.kind.name, started)
        timer.seconds()

    return run


def measure_op_host_s(repeats: int = 5) -> float:
    """Seconds of host work one executor instruction pays beyond its compute (the fastest of
    ``repeats`` rounds: on a shared CPU the slow rounds are other processes' time slices)."""
    run = _instruction_round(OPS_PER_ROUND)
    run()  # warm up: first calls allocate
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best / OPS_PER_ROUND


_CHILD = r"""
import json, os, threading, tempfile
import psutil, torch, torch.distributed as dist
import sysx.train  # everything a rank imports
from sysx.trainers.prediction import import_backward_modules
import_backward_modules()  # as a rank does before its baseline
from sysx.model import ModelConfig
from sysx.model.llama import init_layer, make_layer
from sysx.optim.formula import BetaPowers, Hyper, constants
from sysx.optim.torch_backend import TorchBackend
torch.set_num_threads(1)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
rss0 = status("RssAnon")  # where a rank's plan starts counting: anonymous memory, as the check counts
cfg = ModelConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=64)
block = make_layer(cfg, 1)
init_layer(block, 1)
x = torch.randn(2, 32, cfg.dim, requires_grad=True)
block(x).sum().backward()
hyper = Hyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
def adam_step():  # on a worker thread, as a rank's optimizer lane steps (sysx's Adam, not torch.optim's)
    for p in block.parameters():
        flat, grad = p.detach().reshape(-1), p.grad.reshape(-1)
        m, v, scratch = (torch.zeros_like(flat) for _ in range(3))
        TorchBackend(hyper).step_chunk(flat, grad, m, v, constants(1, 1e-3, hyper, BetaPowers(0.9, 0.999)), scratch)
worker = threading.Thread(target=adam_step)
worker.start(); worker.join()
t = torch.ones(8); dist.all_reduce(t)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so a child of a large process
# would report its parent's peak
peak = status("VmHWM") - status("RssFile") - status("RssShmem")  # the anonymous peak (files stay mapped)
print(json.dumps({"process_bytes": max(0, peak - rss0)}))
dist.destroy_process_group()
"""


def measure_process_bytes(timeout_s: float = PROCESS_TIMEOUT_S) -> int:
    """Bytes of resident memory a training process adds besides its training state, measured in
    a fresh process (a few seconds: it imports torch); 0 when that process fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s, check=True
        )
        return int(json.loads(done.stdout.strip().splitlines()[-1])["process_bytes"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return 0


_BACKWARD_CHILD = r"""
import json, sys
import torch
from sysx.model import ModelConfig
from sysx.model.llama import init_layer, make_layer
from sysx.trainers.prediction import import_backward_modules
import_backward_modules()  # as a rank does before its baseline
args = json.loads(sys.argv[1])
torch.set_num_threads(1)
dtype = getattr(torch, args["dtype"])
cfg = ModelConfig(**args["model"])
index = [1 + i % cfg.n_layers for i in range(args["blocks"])]  # Blocks only, however few the model has
block = torch.nn.Sequential(*(make_layer(cfg, i, dtype=dtype) for i in index))
for i, layer in zip(index, block):
    init_layer(layer, i)
for p in block.parameters():
    p.grad = torch.zeros_like(p)  # planned state: made before the count starts
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
def anon_peak():
    return status("VmHWM") - status("RssFile") - status("RssShmem")
x = torch.randn(1, 1, cfg.dim, dtype=dtype)  # the first kernels' own allocations, before the count
with torch.no_grad():
    block(x)
open("/proc/self/clear_refs", "w").write("5")
rss0 = status("RssAnon")
out = {}
for tokens in args["tokens"]:  # ascending: what the heap keeps of one count serves the next
    x = torch.randn(tokens // args["seq_len"], args["seq_len"], cfg.dim, dtype=dtype)  # micro-batch x sequence
    for _ in range(2):  # a rank's forward without autograd, then recompute and backward (the sub-stage at once)
        with torch.no_grad():
            block(x)
        inp = x.detach().requires_grad_(True)
        y = block(inp)
        y.backward(torch.ones_like(y))
        del inp, y
    out[tokens] = max(0, anon_peak() - rss0)
print(json.dumps(out))
"""


def _backward_peaks(
    cfg: Any, seq_len: int, tokens: list[int], dtype: torch.dtype, blocks: Sequence[int], timeout_s: float
) -> list[dict[int, int]]:
    """:data:`_BACKWARD_CHILD`'s peaks by token count, for a sub-stage of each of ``blocks`` Blocks,
    one fresh process each, all at once (a peak's bytes do not depend on the CPU time the process
    gets); every process still running is killed on the way out (a failure, Ctrl-C)."""
    dt = str(dtype).split(".")[-1]
    procs: list[subprocess.Popen[str]] = []
    try:
        for k in blocks:
            args = {"model": dataclasses.asdict(cfg), "seq_len": seq_len, "tokens": tokens, "dtype": dt, "blocks": k}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BACKWARD_CHILD, json.dumps(args)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        out = []
        deadline = time.monotonic() + timeout_s  # for all of them: they run at once
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
            out.append({int(k): int(v) for k, v in json.loads(stdout.strip().splitlines()[-1]).items()})
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


PROBE_BLOCKS = 4  # the larger sub-stage the backward probe runs (the smaller is one Block)


def measure_backward_bytes(
    cfg: Any,
    seq_len: int,
    token_counts: list[int],
    dtype: torch.dtype,
    timeout_s: float = PROCESS_TIMEOUT_S,
    *,
    blocks: int = PROBE_BLOCKS,
) -> dict[int, tuple[int, int]]:
    """What the backward of a sub-stage of Blocks of ``cfg`` (a :class:`~sysx.model.ModelConfig`)
    holds at its peak, by token count (micro-batches of ``seq_len``-token sequences, a multiple of
    it): ``(per Block, once)`` bytes, from the peaks of one and of ``blocks`` Blocks recomputed and
    backpropagated together (each in a fresh process, a few seconds, the two at once): a sub-stage
    of ``k`` Blocks holds ``once + k * per_block``. Empty when a process fails.

    ``blocks`` apart, not two: each peak scatters by a few MiB between processes (what glibc keeps
    of the freed workspace), and the per-Block bytes are the difference of two peaks over the
    Blocks between them. One Block against two put the whole scatter in the per-Block bytes, which
    a sub-stage of several Blocks multiplies (tiny at 2048 tokens: 23-34 MiB a Block in four probes,
    issue 27); one against ``blocks`` divides it by ``blocks - 1``. A large model on a small
    machine probes fewer (:func:`sysx.autotune.profile.probe_blocks`)."""
    tokens = sorted(set(token_counts))
    many = max(2, blocks)
    try:
        one, more = _backward_peaks(cfg, seq_len, tokens, dtype, (1, many), timeout_s)
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as exc:
        detail = (getattr(exc, "stderr", None) or "").strip().splitlines()[-1:] or [f"{type(exc).__name__}: {exc}"]
        if isinstance(exc, subprocess.TimeoutExpired):  # its message holds the whole child script
            detail = [f"no answer in {exc.timeout:g} s"]
        log.warning("the backward-memory probe failed (%s); the host plan uses the shape estimate", detail[0])
        return {}
    out = {}
    for t in tokens:
        per_block = max(0, (more[t] - one[t]) // (many - 1))
        out[t] = (per_block, max(0, one[t] - per_block))
    return out
