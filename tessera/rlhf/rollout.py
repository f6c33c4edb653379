"""Responses from the policy being trained, for PPO and GRPO: generated with the paged KV cache
of :mod:`tessera.inference`, from the model's current parameters.

:class:`RolloutGenerator` wraps the live training module (tessera's GPT or a ``transformers``
causal LM) in the engine's runner at each :meth:`~RolloutGenerator.generate` call: no copy of
the model, so the weights an optimizer step just changed are the ones that generate. The model
runs in eval mode (no dropout) during the call and every module's train/eval flag is put back
after it; a ``transformers`` model gets its attention implementation back too.

Each data-parallel replica of the actor generates for its own prompts, by itself: the engine
runs over :meth:`ParallelContext.alone() <tessera.context.ParallelContext.alone>`, a context
of this rank alone, so a generation issues no collective and ranks may take different numbers
of steps. This needs a replica that holds the whole model: tensor, pipeline and sequence
parallelism of size 1, and no ZeRO-3 or Gemini (their parameters are pieces); data parallelism,
ZeRO-1 and ZeRO-2 are fine.

Seeds. A sampled request draws from a generator of its own: request ``i`` of a call with base
seed ``s`` on stream ``r`` is seeded with ``rollout_seeds(s, r, n)[i]``, a hash of the three, so
that responses are the same for the same (``s``, ``r``, ``i``) whatever else shares the batch,
and differ between requests, calls with other seeds, and streams. The stream is the rank's index
along the data axis of the training context (by default the current one), so replicas sampling
the same prompts with the same seed draw differently. Pass a new seed at each call (the PPO
iteration, say), or the same prompts give the same responses; a call with no seed (and
``params.seed`` None) draws a fresh base seed.

Responses include the stop token that ended them (the engine does not return it), ready for
:func:`~tessera.rlhf.batches.build_rollout_batch`. :func:`generate_without_cache` is the
reference: the same requests, seeds and stopping rules, with the whole sequence through the
model for every new token.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.context import ParallelContext, get_context, has_context
from tessera.context.placement import placement_of
from tessera.errors import ConfigError
from tessera.hf.apply import is_hf_model
from tessera.inference.engine import CacheOptions, InferenceEngine
from tessera.inference.models import GPTRunner, HFRunner, Runner
from tessera.inference.params import SamplingParams
from tessera.inference.sampling import request_generator, sample
from tessera.models.gpt import GPT
from tessera.rlhf.batches import SequenceBatch, build_rollout_batch
from tessera.rlhf.protocols import ReleasingStorage

__all__ = [
    "Rollout",
    "RolloutGenerator",
    "generate_without_cache",
    "generation_mode",
    "request_params",
    "rollout_batch",
    "rollout_seeds",
]

_SEED_RANGE = 2**63


@dataclass(frozen=True)
class Rollout:
    """One generated response: ``prompt`` (its ids), ``response`` (the generated ids, ending with
    the stop token when ``finish_reason`` is ``"stop"``; ``"length"``: ``max_tokens`` or the
    model's length was reached) and ``logprobs``, one per response token: its log-probability
    under the model's own distribution (``log_softmax`` of the logits, before temperature,
    top-k and top-p), computed in the generation step. PPO recomputes them in a training forward."""

    prompt: list[int]
    response: list[int]
    finish_reason: str
    logprobs: list[float]


def rollout_seeds(seed: int, stream: int, count: int) -> list[int]:
    """The seeds of requests ``0 .. count-1`` of a call with base ``seed`` on ``stream`` (the data
    rank): each a hash of the three, in ``[0, 2**63)``."""
    return [
        int.from_bytes(hashlib.sha256(f"rollout;{seed};{stream};{i}".encode()).digest()[:8], "little") % _SEED_RANGE
        for i in range(count)
    ]


def request_params(
    params: SamplingParams, count: int, *, seed: int | None = None, stream: int = 0, offset: int = 0
) -> list[SamplingParams]:
    """``params`` for each of ``count`` requests, each sampled request with its own seed
    (:func:`rollout_seeds` of ``seed``, else ``params.seed``, else a fresh random base); the
    requests are numbered from ``offset`` (a share of a larger batch draws the seeds its rows
    would have drawn in the whole batch).
    Greedy requests need no seed and are returned as they are. Stop strings act on text, which
    rollouts do not decode: they are refused (give ``stop_token_ids``)."""
    if params.stop:
        raise ValueError(
            f"stop={params.stop!r}: rollouts are token ids and stop on stop_token_ids only (the byte "
            "tokenizer's newline is 10)"
        )
    if params.greedy:
        return [params] * count
    base = seed if seed is not None else params.seed
    if base is None:
        base = secrets.randbits(63)
    return [replace(params, seed=s) for s in rollout_seeds(base, stream, offset + count)[offset:]]


def rollout_batch(rollouts: Sequence[Rollout], pad_id: int) -> SequenceBatch:
    """:func:`~tessera.rlhf.batches.build_rollout_batch` of the rollouts' prompts and responses."""
    return build_rollout_batch([r.prompt for r in rollouts], [r.response for r in rollouts], pad_id)


# ---- the model ----------------------------------------------------------------------------------
def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a torch DDP wrapper, and checks that one rank holds all of it."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if not (isinstance(model, GPT) or is_hf_model(model)):
        raise ConfigError(
            f"tessera generates rollouts with its GPT and with transformers causal LMs; got {type(model).__name__}"
        )
    if isinstance(model, GPT) and model.config.num_experts:
        raise ConfigError(
            "rollouts from a mixture-of-experts GPT are not supported: generation would add to the routing "
            "statistics training reads, and capacity drops depend on the batch"
        )
    for name, param in model.named_parameters():
        why = _not_whole(param)
        if why is not None:
            raise ConfigError(
                f"parameter {name} is not whole on this rank ({why}): rollouts need a data-parallel replica that "
                "holds the whole model (tensor, pipeline and sequence size 1; no ZeRO-3 or Gemini)"
            )
    return model


def _not_whole(param: torch.Tensor) -> str | None:
    """Why ``param`` is not whole on this rank, or None when it is."""
    placement = placement_of(param)
    if param.is_meta:
        return "it is on the meta device: build and fill the model first"
    if _released(placement.storage):
        return "it is a ZeRO-3/Gemini piece"
    if placement.stage is not None:
        return f"it belongs to pipeline stage {placement.stage}"
    split = [a for a in placement.split_axes if placement.mesh is None or placement.mesh.size(a) > 1]
    return f"it is split along {', '.join(split)}" if split else None


def _released(storage: object | None) -> bool:
    """Whether a parameter's storage may be released between uses (ZeRO-3's chunks; Gemini's,
    which also move between tiers): ZeRO-1 and 2 keep every parameter whole on every rank. A
    storage that does not say (:class:`ReleasingStorage`) is taken to release it."""
    if storage is None:
        return False
    return not isinstance(storage, ReleasingStorage) or storage.releases_parameters


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _max_len(model: nn.Module) -> int:
    if isinstance(model, GPT):
        return model.config.max_seq_len
    config: Any = model.config
    return int(getattr(config, "max_position_embeddings", None) or config.n_positions)


def _vocab_size(model: nn.Module) -> int:
    config: Any = model.config
    return int(config.vocab_size)


@contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off) inside the block; every module's own train/eval
    flag is put back after it, whatever it was."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextmanager
def _attention_kept(model: nn.Module) -> Iterator[None]:
    """A ``transformers`` model's attention implementation put back after the block (the
    engine's runner switches it to the paged attention, which only runs inside its steps)."""
    if not is_hf_model(model):
        yield
        return
    config: Any = model.config
    before = config._attn_implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def _check_layout(ctx: ParallelContext) -> None:
    """The model's layers run under ``ctx`` (they read the current context): it must leave the
    whole model, and every token of a sequence, on each rank."""
    split = {axis: ctx.size(axis) for axis in ("tensor", "pipeline", "sequence") if ctx.size(axis) > 1}
    if split:
        shown = ", ".join(f"{axis}={size}" for axis, size in split.items())
        raise ConfigError(
            f"rollouts are generated by each data-parallel replica alone, which needs the whole model and "
            f"sequence on one rank; this layout splits them ({shown})"
        )


def _runner(model: nn.Module, ctx: ParallelContext) -> Runner:
    if isinstance(model, GPT):
        return GPTRunner(model, 0, model.config.n_layers + 2, ctx)
    return HFRunner(model, [model], True, True, ctx)


# ---- generation with the KV cache ---------------------------------------------------------------
class RolloutGenerator:
    """Generates responses from ``model``'s current parameters with the paged KV cache, on this
    rank alone (module docstring).

    ``params``: how every request samples and stops (``max_tokens``, ``temperature``, ``top_k``,
    ``top_p``, ``stop_token_ids``; ``seed`` is the base seed when a call gives none).
    ``ctx``: the training context (default: the current one, if any), checked (tensor, pipeline
    and sequence size 1) and read for the stream of seeds: the rank's data index (0 without a
    context). ``stream`` overrides it.
    The KV cache: blocks of ``block_size`` slots, at most ``max_batch`` sequences at once and
    ``max_prefill_tokens`` prompt tokens per prefill step; ``num_blocks`` None sizes it at each
    call for the ``max_batch`` longest requests (prompt plus ``max_tokens``), so that the cache
    never makes a sequence wait; a number fixes it (fewer blocks: fewer sequences at once).
    """

    def __init__(
        self,
        model: nn.Module,
        params: SamplingParams,
        *,
        ctx: ParallelContext | None = None,
        stream: int | None = None,
        max_batch: int = 64,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_prefill_tokens: int = 4096,
    ) -> None:
        ctx = ctx if ctx is not None else (get_context() if has_context() else None)
        if ctx is not None:
            _check_layout(ctx)
        self.model = _unwrapped(model)
        self.params = params
        self.stream = stream if stream is not None else (ctx.local_rank("data") if ctx is not None else 0)
        self.ctx = ParallelContext.alone(_device_of(self.model))
        self.max_batch, self.block_size, self.num_blocks = max_batch, block_size, num_blocks
        self.max_prefill_tokens = max_prefill_tokens
        CacheOptions(num_blocks if num_blocks is not None else 1, block_size, max_batch, max_prefill_tokens)  # checks

    def cache_for(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> CacheOptions:
        """The KV cache of one call (class docstring)."""
        if self.num_blocks is not None:
            return CacheOptions(self.num_blocks, self.block_size, self.max_batch, self.max_prefill_tokens)
        max_len = _max_len(self.model)
        blocks = [-(-min(len(p) + q.max_tokens, max_len) // self.block_size) for p, q in zip(prompts, params)]
        needed = sum(sorted(blocks, reverse=True)[: self.max_batch])
        return CacheOptions(max(needed, 1), self.block_size, self.max_batch, self.max_prefill_tokens)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        seed: int | None = None,
        params: SamplingParams | None = None,
        offset: int = 0,
    ) -> list[Rollout]:
        """A :class:`Rollout` for each prompt (lists of ids), in order. ``seed``: the call's base
        seed (module docstring); ``params`` replaces the generator's for this call; ``offset``:
        the number of the first prompt in a larger batch this call is a share of (its requests
        draw the seeds of those rows)."""
        each = request_params(params or self.params, len(prompts), seed=seed, stream=self.stream, offset=offset)
        if not prompts:
            return []
        with generation_mode(self.model), _attention_kept(self.model):
            engine = InferenceEngine(_runner(self.model, self.ctx), self.ctx, self.cache_for(prompts, each))
            for i, request in enumerate(each):
                if request.n != 1:
                    raise ValueError(f"prompt {i}: a rollout is one sequence per prompt (n=1)")
            results = engine.generate([[int(t) for t in p] for p in prompts], each)
        return [
            Rollout([int(t) for t in prompt], result.sampled, result.finish_reason, result.logprobs)
            for prompt, result in zip(prompts, results, strict=True)
        ]


# ---- the reference: the whole sequence through the model for every token ------------------------
def _last_logits(model: nn.Module, rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """The logits after each row's last token: ``rows`` (unequal lengths) -> ``[R, V]`` float32,
    from one forward of the right-padded batch (causal attention: padding after a token never
    reaches it)."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
    last = torch.tensor([len(row) - 1 for row in rows], device=device)
    if isinstance(model, GPT):
        logits = model(ids)
    else:
        mask = (torch.arange(width, device=device) <= last[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return logits[torch.arange(len(rows), device=device), last, : _vocab_size(model)].float()


@torch.no_grad()
def generate_without_cache(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    seed: int | None = None,
    stream: int = 0,
    offset: int = 0,
) -> list[Rollout]:
    """What :meth:`RolloutGenerator.generate` gives, without a KV cache: every step runs the
    whole sequences (prompt and tokens so far) of the unfinished requests through ``model``, one
    right-padded batch, and samples each request's next token from its last logits. The same
    per-request seeds (``seed``, ``stream``, ``offset``), sampling and stopping rules (a stop token ends a
    request and is kept; ``max_tokens`` or the model's length ends it with ``"length"``). The
    reference of the tests and the baseline of ``tessera bench rlhf-generate``."""
    model = _unwrapped(model)
    each = request_params(params, len(prompts), seed=seed, stream=stream, offset=offset)
    max_len, device = _max_len(model), _device_of(model)
    for i, prompt in enumerate(prompts):
        if not prompt or len(prompt) >= max_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens; a prompt needs 1 to {max_len - 1} (the model's length)"
            )
    generators = [request_generator(p, i) for i, p in enumerate(each)]
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    reasons = [""] * len(prompts)
    active = list(range(len(prompts)))
    with generation_mode(model):
        while active:
            logits = _last_logits(model, [[int(t) for t in prompts[i]] + responses[i] for i in active], device)
            tokens = sample(logits, [each[i] for i in active], [generators[i] for i in active])
            chosen = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0].tolist()
            still = []
            for i, token, logprob in zip(active, tokens.tolist(), chosen, strict=True):
                responses[i].append(token)
                logprobs[i].append(logprob)
                if token in each[i].stop_token_ids:
                    reasons[i] = "stop"
                elif len(responses[i]) >= each[i].max_tokens or len(prompts[i]) + len(responses[i]) >= max_len:
                    reasons[i] = "length"
                else:
                    still.append(i)
            active = still
    return [
        Rollout([int(t) for t in prompt], responses[i], reasons[i], logprobs[i]) for i, prompt in enumerate(prompts)
    ]
