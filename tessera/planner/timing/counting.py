"""How the step-time model counts communication: one (op, axis)'s logical bytes and calls as the
comm ledger counts them (``k (P-1)/P x payload``), the book that sums them over layers and
micro-batches, and the shape of one micro-batch on one rank that every family's formulas read."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.planner.layout import Layout
from tessera.planner.spec import ModelSpec, Workload

#: op -> k in "k (P-1)/P x payload" (the ledger's ring factors); send and recv count the payload
_RING = {
    "all_reduce": 2.0,
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "broadcast": 1.0,
    "reduce": 1.0,
    "all_to_all": 1.0,
}
P2P = ("send", "recv")
#: ZeRO's chunk size and DDP's bucket size (tessera's and torch's defaults), bytes
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Traffic:
    """One (op, axis) of a step on one rank: ``bytes`` as the ledger counts them (logical bytes),
    ``calls`` collective calls, ``group`` ranks in the group."""

    op: str
    axis: str
    group: int
    bytes: float
    calls: float


class Book:
    """Accumulates traffic. Every add is scaled by ``times`` (layers x micro-batches); forward
    work by ``1 + recompute`` as well (activation checkpointing runs it again)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[float]] = {}
        self.times = 1.0
        self.recompute = 0.0

    def add(self, op: str, axis: str, group: int, payload: float, calls: float = 1.0, fwd: bool = False) -> None:
        """``calls`` calls moving ``payload`` bytes in all (each call's tensor summed)."""
        if group <= 1 or payload <= 0:
            return
        scale = self.times * (1.0 + self.recompute if fwd else 1.0)
        logical = payload if op in P2P else _RING[op] * (group - 1) / group * payload
        entry = self.entries.setdefault((op, axis), [float(group), 0.0, 0.0])
        entry[1] += scale * logical
        entry[2] += scale * calls

    def traffic(self) -> dict[tuple[str, str], Traffic]:
        return {key: Traffic(key[0], key[1], int(g), b, c) for key, (g, b, c) in self.entries.items()}


def round_up(n: float, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return int(math.ceil(n / k) * k)


def blocks_per_rank(full: int, parts: int, groups: int = 1) -> int:
    """Units per rank of a dimension of ``groups`` fused parts, each padded and split ``parts`` ways."""
    return groups * math.ceil(full // groups / parts)


# ---- the model as layers ---------------------------------------------------------------------


def block_linears(m: ModelSpec) -> list[tuple[int, int, int]]:
    """(in, out, fused parts) of a block's Linears in order: qkv, attention out, MLP in, MLP out.
    Fused as Megatron fuses them (q, k, v in one; a gated MLP's gate and up in one)."""
    h, kv, ff = m.d_model, m.kv_dim, m.ff_dim
    qkv = (h, h + 2 * kv, 3 if kv == h else 1)
    mlp_in = (h, 2 * ff, 2) if m.gated_mlp else (h, ff, 1)
    return [qkv, (h, h, 1), mlp_in, (ff, h, 1)]


@dataclass(frozen=True)
class Shape:
    """One micro-batch on one rank: ``b`` samples of ``s`` tokens (the whole sequence), ``tokens``
    this rank's (after the sequence and the tensor mode's batch split, padded), ``width`` its
    hidden block; bytes of an element: ``e`` of the matmuls' operands and outputs, ``er`` of the
    residual stream (embeddings, norms: fp32 under autocast), ``pe`` of parameter gradients."""

    b: int
    s: int
    tokens: int
    width: int
    e: int
    er: int
    pe: int


def micro_batch_shape(m: ModelSpec, layout: Layout, workload: Workload) -> Shape:
    b, s = layout.micro_batch, workload.seq_len or m.seq_len
    local = s // layout.sequence
    q, mode = layout.grid, layout.tensor_mode
    if layout.tensor == 1 or mode == "1d":
        parts = layout.tensor if layout.sequence_parallel else 1
        tokens, width = b * local // parts, m.d_model
    elif mode == "3d":
        tokens, width = round_up(b, q) // q * local, blocks_per_rank(m.d_model, q * q)
    else:
        tokens, width = round_up(b, layout.depth * q) // (layout.depth * q) * local, blocks_per_rank(m.d_model, q)
    e = workload.element_bytes
    # without ZeRO, low precision is autocast over fp32 parameters; ZeRO keeps them in the dtype
    wide = 4 if layout.zero == 0 else e
    return Shape(b, s, tokens, width, e, wide, wide)
