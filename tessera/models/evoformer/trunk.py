"""A small Evoformer trunk with a distogram head, and the synthetic proteins it learns from.

The trunk embeds an MSA of amino-acid ids [B, S, R] (its first row the target sequence) into the
MSA representation, the target sequence's outer sum and the residues' relative positions into the
pair representation, runs N :class:`~tessera.models.evoformer.block.EvoformerBlock` s and predicts,
for every residue pair, which of ``bins`` distance ranges the pair's distance falls in (AlphaFold's
distogram head: a linear layer of the symmetrised pair representation). :class:`DistogramLoss`
is the cross-entropy over the pairs.

:class:`SyntheticProteins` draws proteins from a seed: a random chain in 3-D (unit steps, so that
neighbours along the chain are close) whose distance map gives the bins, and an MSA of random
sequences in which every pair of residues closer than a contact distance co-varies (the second
residue of a contact is a fixed function of the first in every sequence). The co-variation is what
the outer product mean can read: the distogram loss falls as the trunk learns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.evoformer.block import EvoformerBlock, EvoformerConfig

AMINO_ACIDS = 20
GAP = 20  # the MSA's gap token; 21 ids in all


@dataclass(frozen=True)
class TrunkConfig:
    """``blocks`` Evoformer blocks of ``block``; relative positions clipped at ``max_relative``;
    the distogram's ``bins`` between ``min_distance`` and ``max_distance`` (the last bin open)."""

    blocks: int = 2
    block: EvoformerConfig = field(default_factory=EvoformerConfig)
    max_relative: int = 16
    bins: int = 16
    min_distance: float = 1.0
    max_distance: float = 8.0

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.bins < 2 or self.max_relative < 1:
            raise ValueError(f"TrunkConfig: blocks, max_relative >= 1 and bins >= 2; got {self}")
        if not 0 < self.min_distance < self.max_distance:
            raise ValueError(
                f"TrunkConfig: 0 < min_distance < max_distance; got {self.min_distance}, {self.max_distance}"
            )

    def bin_edges(self) -> torch.Tensor:
        """The ``bins - 1`` inner edges of the distance bins."""
        return torch.linspace(self.min_distance, self.max_distance, self.bins - 1)


class EvoformerTrunk(nn.Module):
    """``forward(msa [B, S, R]) -> distogram logits [B, R, R, bins]`` (symmetric in the pair)."""

    def __init__(self, config: TrunkConfig) -> None:
        super().__init__()
        self.config = config
        c_m, c_z = config.block.c_m, config.block.c_z
        self.msa_embed = nn.Embedding(AMINO_ACIDS + 1, c_m)
        self.target_left = nn.Embedding(AMINO_ACIDS + 1, c_z)
        self.target_right = nn.Embedding(AMINO_ACIDS + 1, c_z)
        self.relative = nn.Embedding(2 * config.max_relative + 1, c_z)
        self.blocks = nn.ModuleList(EvoformerBlock(config.block) for _ in range(config.blocks))
        self.head_norm = nn.LayerNorm(c_z)
        self.head = nn.Linear(c_z, config.bins)

    def embed(self, msa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The initial MSA [B, S, R, c_m] and pair [B, R, R, c_z] representations."""
        if msa.dim() != 3:
            raise ValueError(f"an MSA batch is [B, sequences, residues] of ids; got shape {tuple(msa.shape)}")
        residues = msa.shape[-1]
        target = msa[:, 0]
        position = torch.arange(residues, device=msa.device)
        offset = (position[None, :] - position[:, None]).clamp(-self.config.max_relative, self.config.max_relative)
        z = self.target_left(target)[:, :, None] + self.target_right(target)[:, None, :]
        z = z + self.relative(offset + self.config.max_relative)
        return self.msa_embed(msa), z

    def distogram(self, z: torch.Tensor) -> torch.Tensor:
        x = self.head_norm(z)
        logits = self.head(x)
        return logits + logits.transpose(1, 2)

    def forward(self, msa: torch.Tensor) -> torch.Tensor:
        m, z = self.embed(msa)
        for block in self.blocks:
            m, z = block(m, z)
        return self.distogram(z)


class DistogramLoss(nn.Module):
    """Cross-entropy of the distogram logits [B, R, R, bins] against the true bins [B, R, R],
    averaged over every pair."""

    def forward(self, logits: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), bins.flatten())


class SyntheticProteins(torch.utils.data.Dataset):
    """``length`` proteins of ``residues`` residues with MSAs of ``sequences`` rows; item ``i`` is
    ``(msa [S, R] int64, bins [R, R] int64)``, a function of ``(seed, i)`` alone."""

    def __init__(
        self,
        length: int,
        residues: int,
        sequences: int,
        config: TrunkConfig,
        *,
        contact: float = 3.0,
        mutation: float = 0.3,
        seed: int = 0,
    ) -> None:
        if length < 1 or residues < 2 or sequences < 1:
            raise ValueError(
                f"SyntheticProteins: length >= 1, residues >= 2, sequences >= 1; got {length}, {residues}, {sequences}"
            )
        if not 0.0 <= mutation <= 1.0:
            raise ValueError(f"mutation={mutation} must be in [0, 1]")
        self.length, self.residues, self.sequences = length, residues, sequences
        self.edges, self.contact, self.mutation, self.seed = config.bin_edges(), contact, mutation, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"protein {index} of a dataset of {self.length}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        r, s = self.residues, self.sequences
        steps = F.normalize(torch.randn(r, 3, generator=g), dim=-1)
        steps[0] = 0.0
        coords = steps.cumsum(dim=0)
        distance = torch.cdist(coords, coords)
        bins = torch.bucketize(distance, self.edges)
        # every sequence: the target's residues, some mutated; then each contact's second residue
        # a fixed function of its first (the co-variation the pair representation can learn)
        target = torch.randint(0, AMINO_ACIDS, (r,), generator=g)
        mutated = torch.rand(s, r, generator=g) < self.mutation
        mutated[0] = False
        msa = torch.where(mutated, torch.randint(0, AMINO_ACIDS, (s, r), generator=g), target.expand(s, r))
        shift = torch.randint(1, AMINO_ACIDS, (r,), generator=g)
        for i, j in (distance < self.contact).triu(diagonal=2).nonzero().tolist():
            msa[:, j] = (msa[:, i] + shift[j]) % AMINO_ACIDS
        return msa, bins


__all__ = ["AMINO_ACIDS", "GAP", "DistogramLoss", "EvoformerTrunk", "SyntheticProteins", "TrunkConfig"]
