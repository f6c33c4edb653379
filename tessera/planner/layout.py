"""A candidate layout: every choice the planner makes, and the tessera config it stands for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from tessera.context.rules import Combination
from tessera.context.rules import problems as rule_problems

TensorMode = Literal["1d", "2d", "2.5d", "3d"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
SequenceMode = Literal["ring_qk", "ring", "all_to_all"]
Checkpointing = Literal["none", "full", "selective"]
Shard = Literal["all", "host"]

#: the config keys of the choices a layout makes (:meth:`Layout.to_config` writes them) and the
#: field of :class:`Layout` each sets: what ``tessera plan --set KEY=VALUE`` may fix
CONFIG_FIELDS: dict[str, str] = {
    "parallel.data": "data",
    "parallel.tensor.size": "tensor",
    "parallel.tensor.mode": "tensor_mode",
    "parallel.tensor.depth": "depth",
    "parallel.tensor.sequence_parallel": "sequence_parallel",
    "parallel.pipeline.size": "pipeline",
    "parallel.pipeline.schedule": "schedule",
    "parallel.sequence.size": "sequence",
    "parallel.sequence.mode": "sequence_mode",
    "zero.stage": "zero",
    "zero.offload_optimizer": "offload",
    "activation_checkpoint.mode": "checkpoint",
    "data.micro_batch_size": "micro_batch",
}


@dataclass(frozen=True)
class Layout:
    """Data, pipeline, tensor and sequence sizes (their product is the world), the pipeline's
    schedule, micro-batches and chunks, the tensor mode (``depth`` for 2.5d; ``sequence_parallel``
    regions for 1d), the sequence mode, the ZeRO stage and optimizer offload, activation
    checkpointing, and the samples of one micro-batch per data-parallel rank. ``shard``: ZeRO's
    ``zero.shard``, over every replica (``"all"``) or over each node's replicas with the shards
    all-reduced across nodes (``"host"``, hybrid sharding; the time model only: the search does
    not choose it and the memory model shards over every replica)."""

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
    shard: Shard = "all"

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
            parts.append(
                f"z{self.zero}" + ("+off" if self.offload else "") + ("(host)" if self.shard == "host" else "")
            )
        if self.checkpoint != "none":
            parts.append("ckpt" if self.checkpoint == "full" else "ckpt-sel")
        parts.append(f"mb{self.micro_batch}")
        return " ".join(parts) if len(parts) > 1 or self.world > 1 else "single " + parts[0]

    def problems(self) -> list[str]:
        """Why this layout cannot run as written (empty when it can): a count below 1, or the
        messages of the layout rules that refuse it (``tessera.context.rules``, the words the
        config and ``initialize`` use)."""
        counts = ("data", "tensor", "pipeline", "sequence", "microbatches", "micro_batch", "chunks", "depth")
        out = [f"{key}={getattr(self, key)} must be at least 1" for key in counts if getattr(self, key) < 1]
        return out or rule_problems(self.combination())

    def combination(self) -> Combination:
        """This layout and its ZeRO stage and offload as the layout rules read them."""
        return Combination(
            data=self.data,
            pipeline=self.pipeline,
            sequence=self.sequence,
            tensor=self.tensor,
            tensor_mode=self.tensor_mode,
            tensor_depth=self.depth,
            sequence_parallel=self.sequence_parallel,
            schedule=self.schedule,
            microbatches=self.microbatches,
            chunks=self.chunks,
            zero=self.zero,
            offload=self.offload,
            host_shard=self.shard == "host",
        )

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
            if self.shard == "host":
                out["zero"]["shard"] = "host"
        if self.checkpoint != "none":
            out["activation_checkpoint"] = {"mode": self.checkpoint}
        return out


def fields_of_config(values: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Layout` fields that config ``values`` (keys of :data:`CONFIG_FIELDS`, values as
    the config holds them) set: ``zero.offload_optimizer`` is ``offload``'s "cpu" or "none"."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = CONFIG_FIELDS[key]
        out[name] = value != "none" if name == "offload" else value
    return out
