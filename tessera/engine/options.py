"""What the engine and ``initialize`` need to know of a run, as small typed values that the top
layer builds (from the config, see ``tessera.config.options``); no config is read below it."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.compiling.options import CompileOptions
from tessera.gemini.options import GeminiOptions
from tessera.parallel.pipeline.stage import PipelineOptions
from tessera.zero.policy import ZeroOptions


@dataclass(frozen=True)
class LossScaleOptions:
    """fp16 loss scaling: ``dynamic`` or a fixed ``initial_scale``, and the dynamic rule."""

    initial_scale: float = 2.0**16
    dynamic: bool = True
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0


@dataclass(frozen=True)
class TrainingOptions:
    """One run's training settings.

    ``precision``: compute dtype (``"fp32"``, ``"bf16"``, ``"fp16"``); ``loss_scale``: fp16 only;
    ``gradient_accumulation``: micro-steps per optimizer step; ``clip_grad_norm``: the global
    norm bound (None: no clipping); ``zero``: the sharded optimizer's settings (None: ZeRO off);
    ``gemini``: the chunk memory manager's settings (None: Gemini off);
    ``pipeline``: how to cut and run pipeline stages (used when the layout has them); ``seed``:
    the data loaders' shuffling seed; ``recompute`` and ``recompute_every``: activation
    checkpointing of the model's blocks ("none", "full", "selective"; one block in every
    ``recompute_every``); ``compile``: how the model is compiled (None: eager).
    """

    precision: str = "fp32"
    loss_scale: LossScaleOptions | None = None
    gradient_accumulation: int = 1
    clip_grad_norm: float | None = None
    zero: ZeroOptions | None = None
    gemini: GeminiOptions | None = None
    pipeline: PipelineOptions = PipelineOptions()
    seed: int = 42
    recompute: str = "none"
    recompute_every: int = 1
    compile: CompileOptions | None = None

    def __post_init__(self) -> None:
        if self.precision == "fp16" and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScaleOptions())
