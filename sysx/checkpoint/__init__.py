"""Checkpoints: layer-keyed shards, atomic and crash-safe saves, exact resume.

* :mod:`~sysx.checkpoint.files` - fsync, atomic replace, group-readable modes;
* :mod:`~sysx.checkpoint.store` - the checkpoint folder: partial -> commit -> ``latest``, rotation;
* :mod:`~sysx.checkpoint.layer_state` - one flat layer's weights, Adam moments and step, as safetensors;
* :mod:`~sysx.checkpoint.saver` - snapshot in host memory, write on a thread, measure the stall;
* :mod:`~sysx.checkpoint.reader` - open a checkpoint, read and verify what one rank needs;
* :mod:`~sysx.checkpoint.pretrained` - ``model.init_from``: pretrained weights layer by layer, and the job's model shape;
* :mod:`~sysx.checkpoint.convert` - ``sysx convert``: sysx model file or checkpoint <-> Hugging Face folder.
"""

from sysx.checkpoint.layer_state import LayerState
from sysx.checkpoint.reader import Checkpoint, find_resume
from sysx.checkpoint.saver import CheckpointSaver, SaveReport
from sysx.checkpoint.store import CheckpointDir, CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointDir",
    "CheckpointError",
    "CheckpointSaver",
    "LayerState",
    "SaveReport",
    "find_resume",
]
