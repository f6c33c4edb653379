"""Layer 3: ZeRO, the sharded optimizer over the data axis (stages 1-3, optional CPU offload)."""

from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.stage3 import ZeroStage3
from tessera.zero.wrap import zero_optimizer

__all__ = ["ZeroOptimizer", "ZeroStage3", "zero_optimizer"]
