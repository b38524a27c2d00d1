"""A prototype, not sysx code: the window keeps each Block's forward graph instead of capturing and
replaying its sites, keyed by the Block's activation slot (every slot is a Block's own when nothing
slides). It still allocates the planned ring, so it shows the time and the losses, not the memory.

Copy it as ``sitecustomize.py`` into an empty folder DIR, then compare:

    SYSX_KEEP_GRAPH=1 PYTHONPATH=.:DIR .venv/bin/python -m sysx.train schedule=single model=tiny ...
    PYTHONPATH=.:DIR .venv/bin/python -m sysx.train schedule=single model=tiny ...
"""

import os

if os.environ.get("SYSX_KEEP_GRAPH"):
    import torch

    import sysx.single.executor as executor
    from sysx.single.op_profile import run_layer

    graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run_captured(layer, x, profile, layout, slot, *, kv=None):
        saved = layout.view(slot, layout.input)
        saved.copy_(x)
        xin = saved.detach().requires_grad_(True)
        with torch.enable_grad():
            y = run_layer(layer, xin, kv)
        graphs[slot.data_ptr()] = (xin, y)
        return y.detach()

    def backward_replayed(layer, grad_out, profile, layout, slot, *, stats=None, kv=None):
        xin, y = graphs.pop(slot.data_ptr())
        torch.autograd.backward(y, grad_out)
        return xin.grad

    executor.run_captured = run_captured
    executor.backward_replayed = backward_replayed
