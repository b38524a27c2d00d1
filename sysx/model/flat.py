"""One flat 1-D buffer for the parameters (and one for the gradients) of a stage.

A stage is a contiguous slice of the flat layer list. ``FlatLayout.from_modules`` records where
each parameter lives in one buffer; ``bind`` makes the parameters views of such a buffer (on any
device), so one copy moves a stage and one optimizer call updates it; ``bind_grads`` makes the
``.grad`` tensors views of a gradient buffer, so backward accumulates straight into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sysx.model.layers import Embedding, Head


@dataclass(frozen=True)
class FlatEntry:
    """One parameter's place in the flat buffer; ``name`` is ``"<module index>.<param name>"``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


def _check_ties(modules: Sequence[nn.Module]) -> None:
    has_embedding = any(isinstance(m, Embedding) for m in modules)
    has_head = any(isinstance(m, Head) for m in modules)
    for m in modules:
        if isinstance(m, Head) and m.tied_to_embedding and not has_embedding:
            raise ValueError(
                "FlatLayout: this slice holds the Head but not the Embedding it is tied to "
                "(tie_embeddings=True: lm_head.weight is embedding.weight); splitting a tie across "
                "stages is not supported: keep both in one stage or use tie_embeddings=False"
            )
        if isinstance(m, Embedding) and m.tied_to_head and not has_head:
            raise ValueError(
                "FlatLayout: this slice holds the Embedding but not the Head tied to it "
                "(tie_embeddings=True: lm_head.weight is embedding.weight); splitting a tie across "
                "stages is not supported: keep both in one stage or use tie_embeddings=False"
            )


def _named_params(modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``modules`` in order, each shared Parameter once (first name wins)."""
    seen: set[int] = set()
    out = []
    for i, module in enumerate(modules):
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((f"{i}.{name}", param))
    return out


class FlatLayout:
    """Where each parameter of a list of modules lives in one contiguous 1-D buffer."""

    def __init__(self, entries: Sequence[FlatEntry], dtype: torch.dtype) -> None:
        self.entries: tuple[FlatEntry, ...] = tuple(entries)
        self.dtype = dtype
        self.numel = sum(e.numel for e in self.entries)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> FlatLayout:
        """Lay out the parameters of ``modules`` (e.g. one stage's layers) back to back.

        All parameters must share one dtype; a Head or Embedding whose tied partner is not in
        ``modules`` is an error.
        """
        modules = list(modules)
        _check_ties(modules)
        named = _named_params(modules)
        if not named:
            raise ValueError("FlatLayout: the modules have no parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            by_dtype = {str(d): [n for n, p in named if p.dtype == d][:3] for d in dtypes}
            raise ValueError(
                f"FlatLayout needs one dtype for all parameters of a stage, found {by_dtype}; "
                f"cast the modules first (e.g. module.to(torch.bfloat16))"
            )
        entries, offset = [], 0
        for name, p in named:
            entries.append(FlatEntry(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        return cls(entries, dtypes.pop())

    def params(self, modules: Sequence[nn.Module]) -> list[nn.Parameter]:
        """The parameters of ``modules`` in layout order, after checking they match the layout."""
        modules = list(modules)
        _check_ties(modules)
        named = _named_params(modules)
        if len(named) != len(self.entries):
            raise ValueError(f"FlatLayout: modules have {len(named)} parameters, the layout has {len(self.entries)}")
        for (name, p), e in zip(named, self.entries):
            if name != e.name or tuple(p.shape) != e.shape:
                raise ValueError(
                    f"FlatLayout: parameter {name} {tuple(p.shape)} does not match layout entry "
                    f"{e.name} {e.shape}; build the layout from these modules"
                )
        return [p for _, p in named]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``buffer`` per entry, shaped like its parameter."""
        self._check_buffer(buffer, "buffer")
        return [buffer[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries]

    def flatten(self, modules: Sequence[nn.Module]) -> torch.Tensor:
        """A new contiguous 1-D copy of the parameters (on their device, in the layout's dtype)."""
        params = self.params(modules)
        return torch.cat([p.detach().reshape(-1) for p in params]).to(self.dtype)

    def bind(self, modules: Sequence[nn.Module], buffer: torch.Tensor) -> None:
        """Make every parameter a view of ``buffer`` (any device; length >= ``numel``).

        The Parameter objects stay the same (optimizers and ties keep working); writes into
        ``buffer`` are seen by the modules and the modules compute on ``buffer``'s device. The
        values are not copied: fill ``buffer`` (e.g. from :meth:`flatten`) before or after.
        A ``.grad`` that no longer matches the parameter's device is dropped: call
        :meth:`bind_grads` after ``bind``.
        """
        params = self.params(modules)
        for p, view in zip(params, self.views(buffer)):
            p.data = view
            if p.grad is not None and p.grad.device != view.device:
                p.grad = None

    def bind_grads(self, modules: Sequence[nn.Module], grad_buffer: torch.Tensor) -> None:
        """Set each ``p.grad`` to a view of ``grad_buffer``, so backward accumulates into it.

        Autograd adds into an existing ``.grad`` in place, so zero ``grad_buffer`` to start a new
        accumulation (``zero_grad(set_to_none=True)`` would detach the views: don't use it).
        ``grad_buffer`` must be on the parameters' device (``bind`` them first).
        """
        params = self.params(modules)
        for p, view in zip(params, self.views(grad_buffer)):
            if view.device != p.device:
                raise ValueError(
                    f"FlatLayout.bind_grads: grad buffer is on {view.device} but the parameters are on "
                    f"{p.device}; bind the parameters to a buffer on {view.device} first"
                )
            p.grad = view

    def _check_buffer(self, buffer: torch.Tensor, what: str) -> None:
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"FlatLayout: {what} must be a contiguous 1-D tensor, got shape {tuple(buffer.shape)}")
        if buffer.dtype != self.dtype:
            raise ValueError(f"FlatLayout: {what} has dtype {buffer.dtype}, the layout needs {self.dtype}")
        if buffer.numel() < self.numel:
            raise ValueError(f"FlatLayout: {what} has {buffer.numel()} elements, the layout needs {self.numel}")
