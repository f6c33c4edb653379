"""Choosing the next token of each request from its logits.

Each request draws from a CPU ``torch.Generator`` of its own (:func:`request_generator`), and
:func:`sample` reads only that request's row of logits and its generator, so a seeded request
gives the same tokens whatever else shares the batch. A sampled row is filtered in this order:
temperature, top-k, top-p (on the distribution top-k left), then one ``torch.multinomial`` draw.
Greedy rows (``temperature == 0``) take the argmax, all of them in one call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from tessera.inference.params import SamplingParams

__all__ = ["request_generator", "sample", "sampling_distribution", "shaped", "top_logprobs"]

_SEED_RANGE = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
# Drawn once per process: unseeded requests of one process differ by their index, and two
# processes (or two runs) do not repeat each other's streams.
_UNSEEDED_BASE = int.from_bytes(os.urandom(8), "little")


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: neighbouring request indices get unrelated seeds."""
    value = (value + 0x9E3779B97F4A7C15) % _SEED_RANGE
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) % _SEED_RANGE
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) % _SEED_RANGE
    return value ^ (value >> 31)


def request_generator(params: SamplingParams, request_index: int) -> torch.Generator | None:
    """The CPU generator a request samples with: seeded with ``params.seed`` when it has one (so
    the request is reproducible), else from this process's entropy and ``request_index`` (the
    engine's running number of the request, so unseeded requests differ). None when greedy."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else _mix64(_UNSEEDED_BASE + request_index)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed % _SEED_RANGE)
    return generator


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens one sampled request may draw and their probabilities: ``logits [V]`` ->
    ``(ids [K] int64 or None, probs [K] float32)``; ``ids`` None means every token (``K == V``).

    ``logits / temperature``, then top-k keeps the k largest, then top-p keeps the smallest set
    of the most probable remaining tokens whose probability (renormalised after top-k) reaches
    ``top_p``; at least one token is always kept."""
    if params.greedy:
        raise ValueError("sampling_distribution: a greedy request (temperature=0) takes the argmax")
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    use_top_k = 0 < params.top_k < vocab
    if not use_top_k and params.top_p >= 1.0:
        return None, torch.softmax(scaled, dim=-1)
    if use_top_k:
        values, ids = torch.topk(scaled, params.top_k)  # sorted, largest first
    else:
        values, ids = torch.sort(scaled, descending=True, stable=True)
    if params.top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        kept = max(1, int((mass_before < params.top_p).sum()))  # a prefix: the mass only grows
        values, ids = values[:kept], ids[:kept]
    return ids, torch.softmax(values, dim=-1)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id drawn from ``logits [V]`` as ``params`` say, with ``generator`` (CPU)."""
    ids, probs = sampling_distribution(logits, params)
    choice = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return choice if ids is None else int(ids[choice])


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The next token of each request: ``logits [N, V]`` (any float dtype, computed in float32)
    -> ``[N]`` int64 on the logits' device. Row ``i`` follows ``params[i]``: greedy rows take
    the argmax (ties: the lowest id), the others draw with ``generators[i]`` (a CPU generator,
    :func:`request_generator`) from :func:`sampling_distribution`."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [N, V], got shape {tuple(logits.shape)}")
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"sample: {logits.shape[0]} rows of logits, {len(params)} params and {len(generators)} generators"
        )
    if all(p.greedy for p in params):  # the common case: one argmax, no row bookkeeping
        return logits.float().argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        tokens[rows] = logits[rows].float().argmax(dim=-1)
    sampled, draws = [], []
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        if generator is None:
            raise ValueError(f"sample: row {i} samples (temperature={p.temperature}) but has no generator")
        sampled.append(i)
        draws.append(_draw(logits[i], p, generator))
    if sampled:  # one copy to the logits' device, not one per row
        tokens[torch.tensor(sampled, device=logits.device)] = torch.tensor(draws, device=logits.device)
    return tokens


def shaped(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """``logits [V]`` with the request's ``logit_bias`` added and OpenAI's presence and
    frequency penalties taken off the tokens it ``generated``: ``logit[t] -= count(t) *
    frequency_penalty + (count(t) > 0) * presence_penalty``. The row itself when neither applies."""
    if not params.shapes_logits:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=out.device)
        values = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=out.dtype, device=out.device)
        out.index_add_(0, ids, values)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab].to(out)
        out -= counts * params.frequency_penalty + (counts > 0).to(out) * params.presence_penalty
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely tokens of a row of log-probabilities, most likely first (ties: the
    lowest id first)."""
    if k <= 0:
        return ()
    values, ids = torch.sort(logprobs, descending=True, stable=True)
    return tuple(zip(ids[:k].tolist(), values[:k].tolist(), strict=True))
