"""Layer 3: ZeRO, the sharded optimizer over the data axis (stages 1-3 as policies, optional CPU
offload), and the strategy that trains with it."""

from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.policy import ZeroOptions, ZeroPolicy
from tessera.zero.strategy import Zero

__all__ = ["Zero", "ZeroOptimizer", "ZeroOptions", "ZeroPolicy"]
