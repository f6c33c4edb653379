"""Applying policies: :func:`prepare`, which ``tessera.initialize`` calls on a ``transformers``
model, looks its policy up (the built-in ones are registered on import: GPT-2, LLaMA, Mixtral, BERT,
ViT), checks the model against the layout, rewrites it and hands the optimizer the new
parameters.

A model without a policy, or a layout the policy does not implement, fails there naming the
model class, the rule and the layouts that do work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.hf import bert, gpt2, llama, mixtral, vit
from tessera.hf.policy import Policy, served
from tessera.init.recording import recording_of

__all__ = ["is_hf_model", "policy_for", "prepare", "registered"]

BUILTIN = (gpt2.POLICY, llama.POLICY, mixtral.POLICY, bert.POLICY, vit.POLICY)


def registered() -> dict[str, Policy]:
    """The policies by model class name."""
    return dict(served())


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (checked without importing transformers)."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def policy_for(model: nn.Module) -> Policy | None:
    return served().get(type(model).__name__)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext) -> nn.Module:
    """Parallelize the ``transformers`` model ``model`` in place for ``ctx``'s tensor axis and
    pipeline stages (nothing to do with one tensor rank and one stage) and point ``optimizer``
    at the new parameters (None: a model for inference, without one). Raises ConfigError when no policy serves the model, the mode, or the
    model's configuration."""
    if not is_hf_model(model):
        return model
    _record_initialisation(model)
    pipelined, sequenced = ctx.size("pipeline") > 1, ctx.size("sequence") > 1
    spread = ctx.size("expert") > 1
    if ctx.size("tensor") == 1 and not pipelined and not sequenced and not spread:
        return model
    policy = policy_for(model)
    if ctx.size("tensor") > 1:
        _split_tensors(model, optimizer, ctx, policy)  # the policy spreads the experts too
    elif spread:
        _spread_experts(model, optimizer, ctx, policy)
    if sequenced:
        _split_sequences(model, ctx, policy)
    if pipelined:
        _cut_stages(model, ctx, policy)
    return model


def _record_initialisation(model: nn.Module) -> None:
    """A ``transformers`` model built under ``tessera.deferred_init()`` to be made with random
    values: run its own weight initialisation into the recording (``initialize`` calls this
    inside ``continue_recording``). transformers (5.x) skips ``_init_weights`` while the tensors
    are on the meta device, which would leave torch's defaults (embeddings N(0, 1) where the
    model draws N(0, 0.02)); a model whose values come from a folder is left alone."""
    rec = recording_of(itertools.chain(model.parameters(), model.buffers()))
    initialise = getattr(model, "initialize_weights", None)
    if rec is not None and rec.values is None and callable(initialise):
        initialise()


def _split_sequences(model: nn.Module, ctx: ParallelContext, policy: Policy | None) -> None:
    cls = type(model).__name__
    if policy is None or policy.sequence is None:
        served = ", ".join(sorted(n for n, p in registered().items() if p.sequence is not None)) or "none"
        raise ConfigError(
            f"parallel.sequence.size={ctx.size('sequence')}: tessera has no sequence-parallel policy for the "
            f"transformers model {cls} (sequence-parallel policies serve: {served}). Layouts that work without "
            "one: data parallel, ZeRO 1-3 and Gemini, and 1d tensor parallelism with sequence_parallel=True"
        )
    policy.sequence(model, ctx)


def _split_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext, policy: Policy | None
) -> None:
    cls = type(model).__name__
    mode = ctx.dims.tensor_mode
    layout = f"parallel.tensor = dict(size={ctx.size('tensor')}, mode={mode!r})"
    works = "data parallel, ZeRO 1-3 and Gemini (parallel.tensor.size=1)"
    if policy is None:
        served = ", ".join(sorted(registered())) or "none"
        raise ConfigError(
            f"{layout}: tessera has no tensor-parallel policy for the transformers model {cls} (policies "
            f"serve: {served}). Layouts that work without one: {works}; or write a policy and register "
            "it with tessera.hf.register_policy (docs/hf.md)"
        )
    if mode not in policy.modes:
        raise ConfigError(
            f"{layout}: the {policy.name} policy for {cls} implements tensor mode(s) "
            f"{', '.join(policy.modes)}, not {mode!r}. Layouts that work: those modes, or {works}"
        )
    if ctx.dims.sequence_parallel and not policy.sequence_parallel:
        raise ConfigError(f"{layout}: the {policy.name} policy for {cls} has no sequence-parallel regions")
    broken = policy.check(model, ctx)
    if broken:
        raise ConfigError(
            f"{layout}: {cls} cannot be split this way: {'; '.join(broken)}. Layouts that work: a tensor "
            f"size that divides them, or {works}"
        )
    _rewrite(model, optimizer, lambda: policy.apply(model, ctx))


def _spread_experts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext, policy: Policy | None
) -> None:
    cls = type(model).__name__
    if policy is None or policy.experts is None:
        served = ", ".join(sorted(n for n, p in registered().items() if p.experts is not None)) or "none"
        raise ConfigError(
            f"parallel.expert.size={ctx.size('expert')}: tessera has no mixture-of-experts policy for the "
            f"transformers model {cls} (expert policies serve: {served}); a dense model has no experts to "
            "spread: set parallel.expert.size=1"
        )
    broken = policy.check(model, ctx)
    if broken:
        raise ConfigError(
            f"parallel.expert.size={ctx.size('expert')}: {cls} cannot be split this way: {'; '.join(broken)}"
        )
    spread = policy.experts
    _rewrite(model, optimizer, lambda: spread(model, ctx))


def _rewrite(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, rewrite: Callable[[], dict[int, nn.Parameter]]
) -> None:
    """Run a policy's ``rewrite`` of ``model`` (it returns old parameter id -> new parameter) and
    point ``optimizer`` (None: none) at the new parameters."""
    if optimizer is not None:
        _check_optimizer_fresh(optimizer)
    # the policy maps parameters by id(): the old ones must outlive it (an optimizer keeps them
    # alive; without one a freed parameter's id could be handed to a new one and alias them)
    old = list(model.parameters())
    replaced = rewrite()
    del old
    if optimizer is not None:
        _repoint(optimizer, replaced)


def _cut_stages(model: nn.Module, ctx: ParallelContext, policy: Policy | None) -> None:
    """Give ``model`` its pipeline layers (``model.pipeline_layers()``, which the pipeline
    partitioner reads) from its policy."""
    cls = type(model).__name__
    layout = f"parallel.pipeline.size={ctx.size('pipeline')}"
    works = "data parallel, ZeRO 1-3 and Gemini (parallel.pipeline.size=1)"
    if policy is None or policy.pipeline is None:
        served = ", ".join(sorted(n for n, p in registered().items() if p.pipeline is not None)) or "none"
        raise ConfigError(
            f"{layout}: tessera has no pipeline policy for the transformers model {cls} (pipeline policies "
            f"serve: {served}). Layouts that work without one: {works}"
        )
    if ctx.size("tensor") > 1 and ctx.dims.tensor_mode != "1d":
        raise ConfigError(
            f"{layout} with parallel.tensor.mode={ctx.dims.tensor_mode!r}: Hugging Face models are pipelined "
            "with 1d tensor parallelism only (the grid modes cut the batch at the model's entry, which "
            "pipeline stages do not call). Layouts that work: pipeline with tensor mode '1d'"
        )
    layers = policy.pipeline(model)
    object.__setattr__(model, "pipeline_layers", lambda: layers)


def _check_optimizer_fresh(optimizer: torch.optim.Optimizer) -> None:
    if any(len(s) for s in optimizer.state.values()):
        raise ConfigError(
            "tensor parallelism replaces the model's parameters: build the optimizer, but take no step "
            "with it, before tessera.initialize"
        )


def _repoint(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]) -> None:
    """Replace the optimizer's old parameters by the new ones (a tied pair becomes one)."""
    for group in optimizer.param_groups:
        seen: set[int] = set()
        params: list[Any] = []
        for p in group["params"]:
            new = replaced.get(id(p), p)
            if id(new) not in seen:
                seen.add(id(new))
                params.append(new)
        group["params"] = params
