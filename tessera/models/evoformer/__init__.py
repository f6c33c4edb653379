"""AlphaFold 2's Evoformer trunk with a distogram head, and synthetic proteins to train it on
(docs/protein.md). Written from the description in the AlphaFold 2 paper's supplementary
information; one process for now (dynamic axial parallelism is issue #49's next step)."""

from tessera.models.evoformer.block import (
    EvoformerBlock,
    EvoformerConfig,
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    Transition,
    TriangleAttention,
    TriangleMultiplication,
    gated_attention,
)
from tessera.models.evoformer.trunk import AMINO_ACIDS, DistogramLoss, EvoformerTrunk, SyntheticProteins, TrunkConfig

__all__ = [
    "AMINO_ACIDS",
    "DistogramLoss",
    "EvoformerBlock",
    "EvoformerConfig",
    "EvoformerTrunk",
    "MSAColumnAttention",
    "MSARowAttentionWithPairBias",
    "OuterProductMean",
    "SyntheticProteins",
    "Transition",
    "TriangleAttention",
    "TriangleMultiplication",
    "TrunkConfig",
    "gated_attention",
]
