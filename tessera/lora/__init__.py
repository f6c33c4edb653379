"""Layer 2: low-rank adapters (LoRA) on frozen linear layers, in every layout: a layer concern,
not a strategy (the strategies see trainable adapters and a frozen base). See docs/lora.md."""

from tessera.lora.apply import LoraOptions, adapters, apply, disabled, linear_layers
from tessera.lora.layers import LoraLinear

__all__ = ["LoraLinear", "LoraOptions", "adapters", "apply", "disabled", "linear_layers"]
