"""Per-token tensors of alignment: the log-probabilities of chosen tokens, masked reductions,
and the shape checks the losses and advantages share.

The conventions of :mod:`tessera.rlhf.losses` hold here: ``[B, T]`` per-token tensors, ``mask``
true at real tokens, float32 arithmetic for lower-precision inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable

__all__ = ["LogprobsFn", "masked_mean", "masked_sum", "masked_whiten", "token_logprobs"]

LogprobsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""How token log-probs ``[B, T]`` are taken from ``[B, T, V]`` logits and ``[B, T]`` tokens:
:func:`token_logprobs`, or a vocabulary-parallel one bound to a tensor group."""

# token_logprobs works on at most this many logits at a time (64 MiB of float32), so the float32
# copy of a bfloat16 [B, T, V] block never exists whole.
_LOGITS_CHUNK_ELEMENTS = 1 << 24
_WHITEN_EPS = 1e-8  # as TRL's masked_whiten


# ---- checks shared by the losses and advantages ----------------------------------------------


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the arithmetic runs in: float32, or float64 for float64 input."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def shape_of(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def check_same_shape(where: str, reference: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor | None]) -> None:
    """Raise ValueError naming the first tensor in ``others`` whose shape differs from the reference's."""
    ref_name, ref = reference
    for name, tensor in others:
        if tensor is not None and tensor.shape != ref.shape:
            raise ValueError(
                f"{where}: {name} has shape {shape_of(tensor)} but {ref_name} has shape {shape_of(ref)}; they must match"
            )


def check_per_token(where: str, reference: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor | None]) -> None:
    """The reference is a [B, T] tensor and every other one has its shape."""
    ref_name, ref = reference
    if ref.dim() != 2:
        raise ValueError(f"{where}: {ref_name} must be [B, T] (2-D), got shape {shape_of(ref)}")
    check_same_shape(where, reference, *others)


def check_per_sequence(where: str, name: str, x: torch.Tensor, batch: int) -> None:
    if x.shape != (batch,):
        raise ValueError(f"{where}: {name} must be [B] = ({batch},), one value per sequence, got shape {shape_of(x)}")


def check_logits_and_tokens(where: str, logits: torch.Tensor, tokens: torch.Tensor, vocab: str = "V") -> None:
    """``logits`` is ``[B, T, vocab]`` and ``tokens`` is ``[B, T]`` with its B and T."""
    if logits.dim() != 3:
        raise ValueError(f"{where}: logits must be [B, T, {vocab}] (3-D), got shape {shape_of(logits)}")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"{where}: tokens has shape {shape_of(tokens)} but logits has shape {shape_of(logits)}; "
            "tokens must be [B, T] with the logits' B and T"
        )


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with padded slots set to 0, so that neither a huge value nor its gradient leaks out
    of them (``exp`` of a padded log-prob could otherwise make ``0 * inf = nan`` in backward)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def check_right_padded(where: str, mask: torch.Tensor) -> None:
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            f"{where}: mask must be right-padded (each row's real tokens first, then padding), "
            "but a row has a real token after a padded one"
        )


# ---- log-probabilities and masked reductions ---------------------------------------------------


def _logit_blocks(batch: int, length: int, vocab: int) -> list[tuple[slice, slice]]:
    """(rows, positions) slices that cover a ``[B, T, V]`` block of logits in pieces of at most
    ``_LOGITS_CHUNK_ELEMENTS`` logits (one position when a single row of V is larger): several
    whole rows per piece when rows are short, else one row cut along T. Each piece is a view."""
    positions = max(1, _LOGITS_CHUNK_ELEMENTS // max(vocab, 1))
    if positions >= length:
        rows = max(1, _LOGITS_CHUNK_ELEMENTS // max(length * vocab, 1))
        return [(slice(start, start + rows), slice(None)) for start in range(0, batch, rows)]
    return [
        (slice(row, row + 1), slice(start, start + positions))
        for row in range(batch)
        for start in range(0, length, positions)
    ]


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits)[..., token]`` computed block by block in float32.

    Forward keeps only the per-position log-sum-exp; backward rebuilds each block's softmax from
    it, so neither pass holds a float32 copy of all of ``logits``.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        selected = torch.empty(tokens.shape, dtype=compute_dtype, device=logits.device)
        logsumexp = torch.empty_like(selected)
        for rows, positions in _logit_blocks(*logits.shape):
            block = logits[rows, positions].to(compute_dtype)
            logsumexp[rows, positions] = torch.logsumexp(block, dim=-1)
            selected[rows, positions] = block.gather(-1, tokens[rows, positions].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, tokens, logsumexp)
        return selected - logsumexp

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, tokens, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows, positions in _logit_blocks(*logits.shape):
            block = logits[rows, positions].to(logsumexp.dtype)
            grad = grad_out[rows, positions].unsqueeze(-1).to(logsumexp.dtype)
            # d/dz_v of (z_y - logsumexp(z)) = [v == y] - softmax(z)_v
            block_grad = torch.exp(block - logsumexp[rows, positions].unsqueeze(-1)).mul_(-grad)
            block_grad.scatter_add_(-1, tokens[rows, positions].unsqueeze(-1), grad)
            grad_logits[rows, positions] = block_grad
        return grad_logits, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probability of each token under ``logits``: ``[B, T, V], [B, T] -> [B, T]``.

    ``out[b, t] = logits[b, t, tokens[b, t]] - logsumexp_v logits[b, t, v]``, in float32 for
    bfloat16/float16/float32 logits. Equal to ``log_softmax(logits.float(), -1).gather(-1, tokens)``
    but it never materialises a float32 (or log-softmax) copy of the whole ``[B, T, V]`` block: it
    works through the logits in blocks of at most 16M elements, in the forward and in the backward
    pass (which rebuilds each block's softmax from the saved log-sum-exp).

    ``logits[b, t]`` must be the prediction *for* ``tokens[b, t]``; for a causal LM run on
    ``prompt + response`` that is ``logits[:, P - 1 : -1]`` against ``input_ids[:, P:]``.
    Every token must lie in ``[0, V)``: put any valid id (0) in padded slots.
    """
    check_logits_and_tokens("token_logprobs", logits, tokens)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"token_logprobs: tokens must be an integer tensor of token ids, got {tokens.dtype}")
    vocab = logits.shape[-1]
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab)).any()):
        low, high = int(tokens.min()), int(tokens.max())
        raise ValueError(
            f"token_logprobs: token ids must lie in [0, {vocab}) (the vocabulary size), got ids from {low} to {high}"
            " (a -100 ignore label in a padded slot? replace it with 0 first)"
        )
    return cast(torch.Tensor, _TokenLogprobs.apply(logits, tokens.long()))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x[mask])``, over all elements (``dim=None``, a 0-d tensor) or along ``dim``.

    ``x`` and ``mask`` have the same shape; padded entries of ``x`` are ignored whatever they
    hold (inf or nan included), and receive zero gradient."""
    check_same_shape("masked_sum", ("x", x), ("mask", mask))
    kept = zero_padding(compute_dtype(x), bool_mask(mask))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)``, over all elements (``dim=None``) or along ``dim``.

    The count is clamped to at least 1, so an empty mask (or an empty row when ``dim`` is given)
    gives 0, not nan. Padded entries of ``x`` are ignored whatever they hold."""
    check_same_shape("masked_mean", ("x", x), ("mask", mask))
    mask = bool_mask(mask)
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``x`` normalised over its real entries: ``(x - mu) / sqrt(var + 1e-8)``, plus ``mu`` back
    when ``shift_mean`` is False (scale only: used on rewards, whose mean carries meaning).

    ``mu`` and ``var`` are taken over all entries where ``mask`` is true, across the whole batch;
    ``var`` is the unbiased (Bessel-corrected, ``/ (n - 1)``) variance, as TRL's ``masked_whiten``
    uses. Padded entries of the result are 0. Raises ValueError when fewer than two entries are
    real (the unbiased variance needs two)."""
    check_same_shape("masked_whiten", ("x", x), ("mask", mask))
    mask = bool_mask(mask)
    count = int(mask.sum())
    if count < 2:
        raise ValueError(f"masked_whiten: needs at least 2 real entries for an unbiased variance, mask has {count}")
    mean = masked_mean(x, mask)
    centred = zero_padding(compute_dtype(x) - mean, mask)
    variance = centred.square().sum() / (count - 1)
    whitened = centred * torch.rsqrt(variance + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened, mask)
