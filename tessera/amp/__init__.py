"""Mixed precision: autocast for bf16/fp16 and a loss scaler for fp16."""

from tessera.amp.precision import autocast, autocast_operands, compute_dtype
from tessera.amp.scaler import LossScaler

__all__ = ["LossScaler", "autocast", "autocast_operands", "compute_dtype"]
