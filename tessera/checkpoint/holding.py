"""What a rank holds for a checkpoint: its pieces (model values, optimizer states, random
states), each under its index name (``model/<key>``, ``optim/<key>/<state>``,
``rng/rank<r>/<name>``) with its view in full single-process coordinates.

The model's tensors come from the strategy (``Strategy.checkpoint_tensors``), the optimizer's
states from its ``state``. Listing them walks the module tree and builds a view per tensor,
which costs more than copying a small model, so the listing of an engine is kept and reused
while it still holds: the same strategy; the same parameters, buffers and submodules registered
in every module (by identity: a new ``nn.Parameter``, a replaced buffer or submodule, a removed
one are all seen); the same optimizer state tensors (by identity, so an optimizer that replaces
a state tensor instead of updating it in place is seen); each tensor with the dtype and shape it
had (an asynchronous save checks only the tensors it copies, before copying them:
``tessera.checkpoint.sharded._snapshot``). Non-tensor optimizer states and the random states are
read anew at every save. The identity checks iterate in C (``map``, ``chain``) over the
modules' own registries (their ``_parameters``, ``_buffers`` and ``_modules`` dicts): a few
hundredths of a millisecond per hundred tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError
from tessera.checkpoint.protocols import TrainingState
from tessera.checkpoint.runstate import rng_tensors
from tessera.context import ParallelContext
from tessera.context.views import HeldTensor, View, whole_view
from tessera.parallel.strategy import Strategy


@dataclass
class Piece:
    """One tensor of a checkpoint as this rank holds it: its index ``name``, its values, its view."""

    name: str
    tensor: torch.Tensor
    view: View


Signature = list[tuple[str, View, torch.dtype, torch.Size]]


def signature(pieces: list[Piece]) -> Signature:
    """All a save's plan depends on: names, views, dtypes and shapes."""
    return [(p.name, p.view, p.tensor.dtype, p.tensor.shape) for p in pieces]


def kinds(signature: Signature, indices: list[int]) -> list[tuple[torch.dtype, torch.Size]]:
    """The dtypes and shapes of the pieces at ``indices``."""
    return [(signature[n][2], signature[n][3]) for n in indices]


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class Holding:
    """This rank's pieces at one moment (``pieces``: model and optimizer tensors first, in the
    same order while the listing is kept, then the random states) with their ``signature``,
    the optimizer's non-tensor per-parameter states by parameter key, and the tied-parameter
    aliases of the module."""

    pieces: list[Piece]
    signature: Signature
    other: dict[str, dict[str, Any]]
    aliases: dict[str, str]
    kept: bool  # whether the engine's listing was reused (nothing listed anew)


@dataclass
class _Listing:
    strategy: Strategy
    registries: list[dict[str, Any]]  # every module's _parameters, _buffers and _modules
    registered: list[int]  # ids of every module's parameters, buffers and children
    states: list[int]  # ids of the optimizer's per-parameter state values
    dtypes: list[torch.dtype]  # of ``tensors``
    shapes: list[torch.Size]
    tensors: list[torch.Tensor]
    pieces: list[Piece]  # model, then optimizer tensor states
    signature: Signature  # of ``pieces``
    others: list[tuple[str, torch.Tensor, str]]  # (parameter key, parameter, state name): non-tensor states
    aliases: dict[str, str]
    rng_signature: Signature = field(default_factory=list)  # of the last save's random states


_listings: list[_Listing] = []  # the last engine's (one engine saved repeatedly is the common case)


_registries = attrgetter("_parameters", "_buffers", "_modules")
_dtype, _shape = attrgetter("dtype"), attrgetter("shape")


# These run at every asynchronous save while training waits, so they iterate in C (map, chain):
# about a tenth of a microsecond per tensor.
def _registries_of(modules: list[nn.Module]) -> list[dict[str, Any]]:
    return list(chain.from_iterable(map(_registries, modules)))


def _registered(registries: list[dict[str, Any]]) -> list[int]:
    return list(map(id, chain.from_iterable(map(dict.values, registries))))


def _state_ids(states: Any) -> list[int]:
    return list(map(id, chain.from_iterable(map(dict.values, states.values()))))


def dtypes(tensors: Sequence[torch.Tensor]) -> list[torch.dtype]:
    return list(map(_dtype, tensors))


def shapes(tensors: Sequence[torch.Tensor]) -> list[torch.Size]:
    return list(map(_shape, tensors))


def holding(engine: TrainingState, check_layout: bool = True) -> Holding:
    """This rank's pieces of ``engine`` now (a kept listing when it still holds).

    ``check_layout=False`` leaves out checking each kept tensor's dtype and shape, for a caller
    that checks those it uses itself (and calls again after :func:`forget_listings` if one
    changed)."""
    strategy = engine.strategy
    states = strategy.optimizer.state  # parameter -> its state
    listing = _listings[0] if _listings else None
    kept = (
        listing is not None
        and listing.strategy is strategy
        and listing.states == _state_ids(states)
        and listing.registered == _registered(listing.registries)
        and (not check_layout or _layout_holds(listing))
    )
    if not kept:
        _listings.clear()
        listing = _list(engine, states)
        _listings.append(listing)
    assert listing is not None
    other: dict[str, dict[str, Any]] = {}
    for key, param, name in listing.others:
        other.setdefault(key, {})[name] = states[param][name]
    rng, rng_signature = _rng_pieces(engine.ctx, listing)
    return Holding(listing.pieces + rng, listing.signature + rng_signature, other, listing.aliases, kept)


def _rng_pieces(ctx: ParallelContext, listing: _Listing) -> tuple[list[Piece], Signature]:
    """This rank's random states as pieces, and their signature: the same objects as at the
    last save while the states' names and sizes hold (so that comparing signatures is quick)."""
    states = rng_tensors(ctx)
    last = listing.rng_signature
    if len(last) != len(states) or any(
        s[0] != f"rng/rank{ctx.rank}/{k}" or s[2] != v.dtype or s[3] != v.shape
        for s, (k, v) in zip(last, states.items())
    ):
        last = listing.rng_signature = [
            (f"rng/rank{ctx.rank}/{k}", whole_view(v.shape), v.dtype, v.shape) for k, v in states.items()
        ]
    return [Piece(s[0], v, s[1]) for s, v in zip(last, states.values())], last


def _layout_holds(listing: _Listing) -> bool:
    return dtypes(listing.tensors) == listing.dtypes and shapes(listing.tensors) == listing.shapes


def _list(engine: TrainingState, states: Any) -> _Listing:
    strategy = engine.strategy
    held: list[HeldTensor] = strategy.checkpoint_tensors()
    pieces = [Piece(f"model/{h.key}", h.tensor, h.view) for h in held]
    by_id = {id(h.tensor): h for h in held}
    others: list[tuple[str, torch.Tensor, str]] = []
    for param in optimizer_params(strategy.optimizer):
        h = by_id.get(id(param))
        if h is None or param not in states:
            continue  # a parameter this rank does not train (another stage's), or without state yet
        for key, value in states[param].items():
            name = f"optim/{h.key}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.numel() != h.tensor.numel():
                    raise CheckpointError(
                        f"optimizer state {key!r} of {h.key} has {value.numel()} elements, its parameter "
                        f"{h.tensor.numel()}: only states shaped like their parameter can be resharded"
                    )
                pieces.append(Piece(name, value, h.view))
            elif isinstance(value, torch.Tensor):
                pieces.append(Piece(name, value, whole_view(())))
            else:
                others.append((h.key, param, key))
    registries = _registries_of(list(engine.module.modules()))
    tensors = [p.tensor for p in pieces]
    return _Listing(
        strategy=strategy,
        registries=registries,
        registered=_registered(registries),
        states=_state_ids(states),
        dtypes=dtypes(tensors),
        shapes=shapes(tensors),
        tensors=tensors,
        pieces=pieces,
        signature=signature(pieces),
        others=others,
        aliases=aliases(engine.module),
    )


def aliases(module: nn.Module) -> dict[str, str]:
    """Second and later state-dict keys of tied parameters -> the key they are saved under."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[key] = first[id(param)]
        else:
            first[id(param)] = key
    return out


def forget_listings() -> None:
    """Drop the kept listing (it holds references to the engine's tensors)."""
    _listings.clear()
