"""Loss scaling for fp16: scale the loss so small gradients survive in fp16, skip any step whose
gradients overflowed (on any rank), shrink the scale then, grow it after clean steps."""

from __future__ import annotations

from typing import Any


class LossScaler:
    """The scale and its update rule; the engine does the unscaling and the overflow check."""

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        dynamic: bool = True,
        growth_interval: int = 1000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(initial_scale)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_overflow: bool) -> None:
        """Record one step: back off after an overflow, grow after ``growth_interval`` clean steps."""
        if found_overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
