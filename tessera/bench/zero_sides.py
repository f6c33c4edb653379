"""``tessera bench zero``, what is compared: the workload, the sides (one system at one ZeRO
stage), the row groups that pair tessera's side with its anchors, and tessera's side itself
(the anchors are in :mod:`tessera.bench.zero_anchors`; the method is described in
:mod:`tessera.bench.zero`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

StepFn = Callable[[torch.Tensor, torch.Tensor], None]
LossFn = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Workload:
    """The model and data every side trains: GPT ``preset`` (``max_seq_len=seq_len``), one
    micro-batch ``[micro_batch, seq_len]`` of byte tokens per rank and step, AdamW(``lr``)."""

    preset: str = "small"
    seq_len: int = 64
    micro_batch: int = 4
    dtype: str = "fp32"  # or "bf16": tessera mixed_precision, FSDP2 MixedPrecisionPolicy, DeepSpeed bf16
    lr: float = 1e-3
    miniature: bool = False  # a one-block GPT of width 16: warms a process up before measuring

    @property
    def tag(self) -> str:
        return f"gpt-{self.preset} b{self.micro_batch}x{self.seq_len}" + (
            "" if self.dtype == "fp32" else f" {self.dtype}"
        )


@dataclass(frozen=True)
class Side:
    """One system at one ZeRO stage: ``system`` is "tessera", "fsdp2" or "deepspeed"."""

    system: str
    stage: int
    offload: bool = False

    @property
    def label(self) -> str:
        if self.system == "tessera":
            return f"tessera zero{self.stage}" + ("-offload" if self.offload else "")
        if self.system == "fsdp2":
            return "torch FSDP2" + ("" if self.stage == 3 else " no-reshard")
        return "DeepSpeed ZeRO-Offload" if self.offload else f"DeepSpeed ZeRO-{self.stage}"


# row group -> (tessera's side, its anchors)
GROUPS: dict[str, tuple[Side, tuple[Side, ...]]] = {
    "zero1": (Side("tessera", 1), (Side("deepspeed", 1),)),
    "zero2": (Side("tessera", 2), (Side("deepspeed", 2), Side("fsdp2", 2))),
    "zero3": (Side("tessera", 3), (Side("fsdp2", 3), Side("deepspeed", 3))),
    "offload": (Side("tessera", 2, offload=True), (Side("deepspeed", 2, offload=True),)),
}


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (the ``bench`` extra); its import is left to the ranks."""
    return importlib.util.find_spec("deepspeed") is not None


def sides_of(group: str, with_deepspeed: bool) -> list[Side]:
    ours, anchors = GROUPS[group]
    return [ours, *(a for a in anchors if with_deepspeed or a.system != "deepspeed")]


def model_of(w: Workload) -> torch.nn.Module:
    from tessera.models import gpt

    torch.manual_seed(0)  # every side starts from the same weights
    if w.miniature:
        return gpt(w.preset, max_seq_len=w.seq_len, d_model=16, n_heads=2, n_layers=1)
    return gpt(w.preset, max_seq_len=w.seq_len)


def batches_of(w: Workload, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches (inputs, next-token targets) ``[micro_batch, seq_len]`` of this rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = [torch.randint(0, 256, (w.micro_batch, w.seq_len + 1), generator=g) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def build_tessera(side: Side, w: Workload, world: int) -> tuple[StepFn, LossFn, str]:
    import tessera
    from tessera.models import NextTokenLoss
    from tessera.testing import use_layout

    config = {
        "parallel": {"data": world},
        "zero": {"stage": side.stage, "offload_optimizer": "cpu" if side.offload else "none"},
        "mixed_precision": {"dtype": w.dtype},
    }
    use_layout(config=config)
    model = model_of(w)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=w.lr), NextTokenLoss())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(iter([(x, y)]))

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(engine.criterion(engine(x), y))

    return step, loss, side.label
