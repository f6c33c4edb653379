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
had (checked after the copy, by :func:`layout_holds`, when the copy has brought the tensors into
the CPU's caches). Non-tensor optimizer states and the random states are read anew at every
save. The checks cost about 0.1 ms per hundred tensors, cold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError
from tessera.checkpoint.runstate import rng_tensors
from tessera.context.views import HeldTensor, View, whole_view


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
    strategy: Any
    modules: list[nn.Module]
    registered: list[int]  # ids of every module's parameters, buffers and children
    states: list[int]  # ids of the optimizer's per-parameter state values
    layout: list[tuple[torch.dtype, torch.Size]]  # of ``tensors``
    tensors: list[torch.Tensor]
    pieces: list[Piece]  # model, then optimizer tensor states
    signature: Signature  # of ``pieces``
    others: list[tuple[str, torch.Tensor, str]]  # (parameter key, parameter, state name): non-tensor states
    aliases: dict[str, str]


_listings: list[_Listing] = []  # the last engine's (one engine saved repeatedly is the common case)


def _registered(modules: list[nn.Module]) -> list[int]:
    return [id(v) for m in modules for d in (m._parameters, m._buffers, m._modules) for v in d.values()]


def _state_ids(states: Any) -> list[int]:
    return [id(v) for s in states.values() for v in s.values()]


def holding(engine: Any, check_layout: bool = True) -> Holding:
    """This rank's pieces of ``engine`` now (a kept listing when it still holds).

    ``check_layout=False`` leaves out checking each kept tensor's dtype and shape, for a caller
    that checks them later with :func:`layout_holds` (after copying the tensors, which brings
    them into the CPU's caches and makes the check cheap) and calls again if it fails."""
    strategy = engine.strategy
    states = strategy.optimizer.state  # parameter -> its state
    listing = _listings[0] if _listings else None
    kept = (
        listing is not None
        and listing.strategy is strategy
        and listing.states == _state_ids(states)
        and listing.registered == _registered(listing.modules)
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
    ctx = engine.ctx
    rng = [Piece(f"rng/rank{ctx.rank}/{k}", v, whole_view(v.shape)) for k, v in rng_tensors(ctx).items()]
    return Holding(listing.pieces + rng, listing.signature + signature(rng), other, listing.aliases, kept)


def _layout_holds(listing: _Listing) -> bool:
    return listing.layout == [(t.dtype, t.shape) for t in listing.tensors]


def layout_holds(held: Holding) -> bool:
    """Whether the tensors of a kept listing still have their dtypes and shapes (True for one
    listed anew); if not, the listing is dropped."""
    if not held.kept or (_listings and _layout_holds(_listings[0])):
        return True
    _listings.clear()
    return False


def _list(engine: Any, states: Any) -> _Listing:
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
    modules = list(engine.module.modules())
    tensors = [p.tensor for p in pieces]
    return _Listing(
        strategy=strategy,
        modules=modules,
        registered=_registered(modules),
        states=_state_ids(states),
        layout=[(t.dtype, t.shape) for t in tensors],
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
