"""``sysx generate``: sample from a checkpoint, a run directory, a sysx model file or a Hugging Face
Llama folder, with a KV cache, resident on the device or streamed through a ring of layer slots.

Modules: :mod:`~sysx.generate.source` (what ``--model`` names, which tokenizer goes with it),
:mod:`~sysx.generate.text` (tokenizers, chat templates, streaming to the terminal),
:mod:`~sysx.generate.sampling` (greedy, temperature, top-p), :mod:`~sysx.generate.placement`
(resident or streamed under a device budget), :mod:`~sysx.generate.decoder` (prefill + one token per
step over the KV cache) and :mod:`~sysx.generate.cli` (the command).
"""

from __future__ import annotations


class GenerateError(ValueError):
    """A bad input of ``sysx generate``, in one line naming the value and the fix."""
