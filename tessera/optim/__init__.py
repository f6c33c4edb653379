"""Layer 3: optimizers and gradient utilities."""

from tessera.optim.clip import clip_grad_norm_, global_grad_norm

__all__ = ["clip_grad_norm_", "global_grad_norm"]
