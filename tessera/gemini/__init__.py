"""Layer 3: the Gemini memory manager, ZeRO-3 with model state spread over device, host memory
and disk (tiers, policies and the tracer live in ``tessera.memory``)."""

from tessera.gemini.options import GeminiOptions
from tessera.gemini.strategy import Gemini

__all__ = ["Gemini", "GeminiOptions"]
