"""Layer 4: checkpoints. For now full (unsharded) state dicts under the single-process keys,
written atomically as safetensors; sharded checkpoints and resharding come later."""

from tessera.checkpoint.full import full_state_dict, load_full_state_dict, load_weights, save_weights

__all__ = ["full_state_dict", "load_full_state_dict", "load_weights", "save_weights"]
