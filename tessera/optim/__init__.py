"""Layer 3: optimizers and gradient utilities."""

from tessera.optim.clip import clip_grad_norm_
from tessera.optim.host_adam import HostAdamW
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS
from tessera.optim.norms import global_grad_norm, whole_sq_norms
from tessera.optim.schedules import lr_schedule, warmup_then_decay

__all__ = [
    "LAMB",
    "LARS",
    "HostAdamW",
    "clip_grad_norm_",
    "global_grad_norm",
    "lr_schedule",
    "warmup_then_decay",
    "whole_sq_norms",
]
