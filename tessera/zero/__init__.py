"""Layer 3: the sharded optimizer over the data axis (ZeRO stages 1-3 as policies, the device
residence with optional host offload) and the strategy that trains with it; Gemini's tiered
residence is in ``tessera.gemini``."""

from tessera.zero.device import DeviceResidence
from tessera.zero.policy import ZeroOptions, ZeroPolicy
from tessera.zero.sharded import Residence, ShardedOptimizer
from tessera.zero.strategy import Sharded, Zero

__all__ = ["DeviceResidence", "Residence", "Sharded", "ShardedOptimizer", "Zero", "ZeroOptions", "ZeroPolicy"]
