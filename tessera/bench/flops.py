"""Model FLOPs and model FLOPs utilisation (MFU) for the benches.

``MFU = tokens/s x model FLOPs per token / (ranks x peak FLOP/s of one rank)``. The FLOPs are
the model's, not the hardware's (a recomputed forward is not counted again): per token
``6 N + 12 L d s`` (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B): ``6 N`` for the
forward and backward matmuls of ``N`` weights, ``12 L d s`` for attention's scores and weighted
sums over a sequence of ``s`` tokens (every key counted, as PaLM does, also under a causal mask).
``N`` leaves out the position embedding (a lookup, no matmul) and counts a weight shared by the
token embedding and the output head once (the head's matmul); LayerNorm weights and biases,
under 0.1% of a GPT-2's, stay in.

The peak is measured, not read from a data sheet: the best rate of an fp32 matmul on one
intra-op thread (one rank's share of this machine), taken on every rank at once as the ranks
run when they train.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.models.gpt import GPT


def flops_per_token(model: GPT, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward and backward) of a GPT over sequences of
    ``seq_len`` tokens: ``6 N + 12 L d seq_len`` (module docstring)."""
    # named_parameters names a tied weight once
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("pos_emb."))
    return float(6 * n + 12 * model.config.n_layers * model.config.d_model * seq_len)


def matmul_peak(size: int = 2048, repeats: int = 12) -> float:
    """FLOP/s of the fastest of ``repeats`` fp32 ``[size, size] @ [size, size]`` matmuls on this
    process's intra-op threads (one in the benches)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # the first call sets up the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def mfu(tokens_per_s: float, per_token: float, ranks: int, peak_per_rank: float) -> float:
    """Model FLOPs utilisation: the share of ``ranks`` ranks' peak the model's FLOPs fill."""
    return tokens_per_s * per_token / (ranks * peak_per_rank)


__all__ = ["flops_per_token", "matmul_peak", "mfu"]
