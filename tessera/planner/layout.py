"""A candidate layout: every choice the planner makes, and the tessera config it stands for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

TensorMode = Literal["1d", "2d", "2.5d", "3d"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
SequenceMode = Literal["ring_qk", "ring", "all_to_all"]
Checkpointing = Literal["none", "full", "selective"]


@dataclass(frozen=True)
class Layout:
    """Data, pipeline, tensor and sequence sizes (their product is the world), the pipeline's
    schedule, micro-batches and chunks, the tensor mode (``depth`` for 2.5d; ``sequence_parallel``
    regions for 1d), the sequence mode, the ZeRO stage and optimizer offload, activation
    checkpointing, and the samples of one micro-batch per data-parallel rank."""

    data: int = 1
    tensor: int = 1
    tensor_mode: TensorMode = "1d"
    depth: int = 1
    sequence_parallel: bool = False
    pipeline: int = 1
    schedule: Schedule = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    sequence: int = 1
    sequence_mode: SequenceMode = "ring"
    zero: int = 0
    offload: bool = False
    checkpoint: Checkpointing = "none"
    micro_batch: int = 1

    @property
    def world(self) -> int:
        return self.data * self.tensor * self.pipeline * self.sequence

    @property
    def accumulation(self) -> int:
        """Micro-batches per step outside a pipeline (a pipeline runs its ``microbatches``)."""
        return 1 if self.pipeline > 1 else self.microbatches

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.data * self.microbatches

    @property
    def grid(self) -> int:
        """q: the side of the tensor grid (1d: the size itself)."""
        if self.tensor_mode == "2d":
            return math.isqrt(self.tensor)
        if self.tensor_mode == "2.5d":
            return math.isqrt(self.tensor // self.depth)
        if self.tensor_mode == "3d":
            return round(self.tensor ** (1 / 3))
        return self.tensor

    @property
    def splits(self) -> tuple[int, int]:
        """How many ways the tensor mode splits a weight matrix and a hidden vector (a bias, a
        norm): 1d (t, 1: vectors mostly whole), 2d and 2.5d (q^2, q; 2.5d's depth holds copies),
        3d (q^3, q^2)."""
        q = self.grid
        if self.tensor == 1 or self.tensor_mode == "1d":
            return self.tensor, 1
        return (q**3, q * q) if self.tensor_mode == "3d" else (q * q, q)

    def name(self) -> str:
        """A short label: ``dp2 tp4(2d) pp2(1f1b x8) z1 ckpt`` (only the parts in use)."""
        parts = []
        if self.data > 1:
            parts.append(f"dp{self.data}")
        if self.tensor > 1:
            mode = self.tensor_mode + (f" d{self.depth}" if self.tensor_mode == "2.5d" else "")
            mode += " sp" if self.sequence_parallel else ""
            parts.append(f"tp{self.tensor}({mode})")
        if self.sequence > 1:
            parts.append(f"sp{self.sequence}({self.sequence_mode})")
        if self.pipeline > 1:
            chunks = f" v{self.chunks}" if self.chunks > 1 else ""
            parts.append(f"pp{self.pipeline}({self.schedule} x{self.microbatches}{chunks})")
        elif self.microbatches > 1:
            parts.append(f"acc{self.microbatches}")
        if self.zero:
            parts.append(f"z{self.zero}" + ("+off" if self.offload else ""))
        if self.checkpoint != "none":
            parts.append("ckpt" if self.checkpoint == "full" else "ckpt-sel")
        parts.append(f"mb{self.micro_batch}")
        return " ".join(parts) if len(parts) > 1 or self.world > 1 else "single " + parts[0]

    def problems(self) -> list[str]:
        """Why this layout cannot run as written (empty when it can)."""
        out = []
        for key in ("data", "tensor", "pipeline", "sequence", "microbatches", "micro_batch", "chunks", "depth"):
            if getattr(self, key) < 1:
                out.append(f"{key}={getattr(self, key)} must be at least 1")
        if out:
            return out
        q = self.grid
        if self.tensor_mode == "2d" and q * q != self.tensor:
            out.append(f"2d needs a square tensor size, not {self.tensor}")
        if self.tensor_mode == "2.5d" and (self.tensor % self.depth or q * q * self.depth != self.tensor):
            out.append(f"2.5d needs tensor = depth x q^2, not {self.tensor} with depth {self.depth}")
        if self.tensor_mode == "3d" and q**3 != self.tensor:
            out.append(f"3d needs a cubic tensor size, not {self.tensor}")
        if self.sequence_parallel and self.tensor_mode != "1d":
            out.append("sequence_parallel regions are 1d only")
        if self.sequence > 1 and self.tensor > 1 and self.tensor_mode != "1d":
            out.append("a sequence axis composes with 1d tensor parallelism only")
        if self.pipeline > 1 and self.schedule != "gpipe" and self.microbatches < self.pipeline:
            out.append(f"{self.schedule} needs at least {self.pipeline} micro-batches")
        if self.chunks > 1 and self.schedule != "interleaved":
            out.append("chunks > 1 needs the interleaved schedule")
        if self.zero >= 2 and self.pipeline > 1:
            out.append("ZeRO stages 2 and 3 do not run with pipeline stages")
        if self.offload and self.zero == 0:
            out.append("optimizer offload needs a ZeRO stage")
        return out

    def to_config(self) -> dict[str, Any]:
        """The config sections (``tessera.config`` keys) that run this layout."""
        parallel: dict[str, Any] = {
            "data": self.data,
            "tensor": {"size": self.tensor, "mode": self.tensor_mode},
            "pipeline": {"size": self.pipeline},
            "sequence": {"size": self.sequence},
        }
        if self.tensor_mode == "2.5d":
            parallel["tensor"]["depth"] = self.depth
        if self.sequence_parallel:
            parallel["tensor"]["sequence_parallel"] = True
        if self.pipeline > 1:
            parallel["pipeline"].update(schedule=self.schedule, microbatches=self.microbatches)
            if self.chunks > 1:
                parallel["pipeline"]["chunks"] = self.chunks
        if self.sequence > 1:
            parallel["sequence"]["mode"] = self.sequence_mode
        out: dict[str, Any] = {
            "parallel": parallel,
            "gradient_accumulation": self.accumulation,
            "data": {"micro_batch_size": self.micro_batch},
        }
        if self.zero:
            out["zero"] = {"stage": self.zero, "offload_optimizer": "cpu" if self.offload else "none"}
        if self.checkpoint != "none":
            out["activation_checkpoint"] = {"mode": self.checkpoint}
        return out
