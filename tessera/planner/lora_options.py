"""The ``lora`` config section as the planner's model description carries it (its own module:
the model description imports it, and :mod:`tessera.planner.adapters` counts from both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tessera.errors import ConfigError


@dataclass(frozen=True)
class Adapters:
    """The ``lora`` config section as the planner needs it (``tessera.config.schema.LoraConfig``)."""

    rank: int
    targets: tuple[str, ...] = ("all-linear",)
    modules_to_save: tuple[str, ...] = ()
    quantize: Literal["none", "int8", "nf4"] = "none"
    double_quant: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank}: the planner's adapters need a rank of at least 1")

    @classmethod
    def from_config(cls, lora: Any) -> Adapters | None:
        """From a ``LoraConfig``; None when it puts no adapters on (``rank = 0``)."""
        if not lora.rank:
            return None
        return cls(int(lora.rank), tuple(lora.targets), tuple(lora.modules_to_save), lora.quantize,
                   bool(lora.double_quant), float(lora.dropout))  # fmt: skip


__all__ = ["Adapters"]
