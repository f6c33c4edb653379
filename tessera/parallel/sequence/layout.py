"""Which tokens of a sequence each rank of the sequence axis holds.

A sequence of ``length`` tokens is padded to a multiple of the pieces it is cut into and each
of the ``size`` ranks holds an equal share, ``local`` tokens:

- contiguous: ``size`` pieces, rank r holds piece r;
- zigzag (causal load balancing): ``2 * size`` pieces, rank r holds pieces r and
  ``2 * size - 1 - r``, so that under a causal mask every rank has the same work (an early
  piece sees few keys, its mirror many).

Positions past ``length`` are padding: they are never attended to, and what a rank computes for
them is discarded when the sequence is gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """``length`` real tokens split over ``size`` ranks, contiguous or ``zigzag``."""

    length: int
    size: int
    zigzag: bool = False

    def __post_init__(self) -> None:
        if self.length < 1 or self.size < 1:
            raise ValueError(f"SequenceLayout needs length >= 1 and size >= 1 (got {self.length}, {self.size})")

    @property
    def pieces_total(self) -> int:
        return 2 * self.size if self.zigzag else self.size

    @property
    def piece(self) -> int:
        """Tokens per piece."""
        return math.ceil(self.length / self.pieces_total)

    @property
    def padded(self) -> int:
        """The padded sequence length (every rank holds ``padded / size`` tokens)."""
        return self.piece * self.pieces_total

    @property
    def local(self) -> int:
        """Tokens each rank holds."""
        return self.padded // self.size

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """``(global start, tokens)`` of each piece ``rank`` holds, in its local order."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not within the sequence axis of {self.size}")
        order = [rank, 2 * self.size - 1 - rank] if self.zigzag else [rank]
        return [(i * self.piece, self.piece) for i in order]

    def local_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(local offset, global start, tokens)`` of each piece ``rank`` holds."""
        out, offset = [], 0
        for start, n in self.pieces(rank):
            out.append((offset, start, n))
            offset += n
        return out

    def positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions [local] of the tokens ``rank`` holds (padding past ``length``)."""
        return torch.cat([torch.arange(start, start + n, device=device) for start, n in self.pieces(rank)])

    def split(self, x: torch.Tensor, dim: int, rank: int, pad_value: float = 0) -> torch.Tensor:
        """``rank``'s tokens of the whole sequence ``x`` (``length`` along ``dim``), padded."""
        if x.shape[dim] != self.length:
            raise ValueError(f"split: dim {dim} of shape {tuple(x.shape)} is not the sequence length {self.length}")
        x = _pad(x, dim, self.padded, pad_value)
        return torch.cat([x.narrow(dim, start, n) for start, n in self.pieces(rank)], dim=dim)

    def join(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole sequence from every rank's tokens (``parts[r]``: rank r's), padding removed."""
        if len(parts) != self.size:
            raise ValueError(f"join: {len(parts)} parts for a sequence axis of {self.size}")
        shape = list(parts[0].shape)
        shape[dim] = self.padded
        out = parts[0].new_empty(shape)
        for rank, part in enumerate(parts):
            offset = 0
            for start, n in self.pieces(rank):
                out.narrow(dim, start, n).copy_(part.narrow(dim, offset, n))
                offset += n
        return out.narrow(dim, 0, self.length)


def _pad(x: torch.Tensor, dim: int, to: int, value: float) -> torch.Tensor:
    missing = to - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


__all__ = ["SequenceLayout"]
