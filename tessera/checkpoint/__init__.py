"""Layer 4: checkpoints.

- sharded checkpoints (``save``, ``load``): every rank writes what it holds; any layout loads
  them (``tessera.checkpoint.sharded`` and ``loading``; the format in
  ``tessera.checkpoint.format``; checkpoint folders in ``folders``);
- full state dicts under the single-process keys (``full_state_dict``, ``load_full_state_dict``)
  and single safetensors files of weights (``save_weights``, ``load_weights``);
- tools for a checkpoint folder (``tessera.checkpoint.tools``, ``tessera ckpt``): ``inspect``
  what it holds and whether it is complete, ``consolidate`` it into one safetensors file;
- what they need of the run, as typed protocols (``tessera.checkpoint.protocols``):
  ``HoldsStrategy`` for full state dicts, ``TrainingState`` for sharded checkpoints (an
  ``Engine`` is both).
"""

from tessera.checkpoint.folders import complete_checkpoints, is_complete, latest, prune, step_folder
from tessera.checkpoint.format import CheckpointError, read_index
from tessera.checkpoint.full import full_state_dict, load_full_state_dict, load_weights, save_weights
from tessera.checkpoint.loading import load
from tessera.checkpoint.protocols import HoldsStrategy, TrainingState
from tessera.checkpoint.sharded import SaveHandle, save, wait_for_saves
from tessera.checkpoint.tools import consolidate, format_inspection, inspect

__all__ = [
    "CheckpointError",
    "HoldsStrategy",
    "SaveHandle",
    "TrainingState",
    "complete_checkpoints",
    "consolidate",
    "format_inspection",
    "full_state_dict",
    "inspect",
    "is_complete",
    "latest",
    "load",
    "load_full_state_dict",
    "load_weights",
    "prune",
    "read_index",
    "save",
    "save_weights",
    "step_folder",
    "wait_for_saves",
]
