"""Layer 3: optimizers and gradient utilities."""

from tessera.optim.clip import clip_grad_norm_, global_grad_norm
from tessera.optim.schedules import lr_schedule, warmup_then_decay

__all__ = ["clip_grad_norm_", "global_grad_norm", "lr_schedule", "warmup_then_decay"]
