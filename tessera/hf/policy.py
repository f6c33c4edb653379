"""Policies: how to parallelize one family of unmodified Hugging Face models.

A :class:`Policy` names the ``transformers`` classes it serves, the tensor-parallel modes it
implements, the rules a configuration must keep (attention heads divisible by the tensor size,
say) and how to rewrite a model in place for a context. Policies are registered by model class
name (:func:`register_policy`); ``tessera.hf.apply.prepare`` looks a model's up and applies it.
This module also has the helpers policies rewrite models with (:func:`swap`, :func:`retie`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tessera.context import ParallelContext

__all__ = ["Policy", "divides", "register_policy", "replace_module", "retie", "served", "swap"]


@dataclass
class Policy:
    """How to parallelize the ``transformers`` models whose class is one of ``classes``.

    ``modes``: the tensor modes implemented; ``check(model, ctx)`` returns the rules the
    model's configuration breaks under ``ctx`` (empty: none); ``apply(model, ctx)`` rewrites
    the model in place for ``ctx`` (its tensor mode, sequence parallelism) and returns
    ``{id(old parameter): new parameter}`` for the parameters it replaced."""

    name: str
    classes: tuple[str, ...]
    modes: tuple[str, ...]
    check: Callable[[nn.Module, ParallelContext], list[str]]
    apply: Callable[[nn.Module, ParallelContext], dict[int, nn.Parameter]]
    notes: str = ""
    sequence_parallel: bool = True  # 1D sequence-parallel regions implemented
    # the model (rewritten for the tensor layout) as layers for pipeline stages; None: no pipeline
    pipeline: Callable[[nn.Module], list[nn.Module]] | None = None
    # make the model attend over the sequence axis (ring, all-to-all); None: not supported
    sequence: Callable[[nn.Module, ParallelContext], None] | None = None
    # spread the model's mixture-of-experts blocks over the expert axis (``apply`` does it too
    # when the tensor axis is split), old id -> new parameter; None: the model has no experts
    experts: Callable[[nn.Module, ParallelContext], dict[int, nn.Parameter]] | None = None


_POLICIES: dict[str, Policy] = {}


def register_policy(policy: Policy, *, replace: bool = False) -> None:
    """Serve ``policy.classes`` with ``policy`` (a class already served fails unless ``replace``)."""
    for name in policy.classes:
        if name in _POLICIES and not replace:
            raise ValueError(f"{name} already has the policy {_POLICIES[name].name!r}; pass replace=True")
    for name in policy.classes:
        _POLICIES[name] = policy


def served() -> dict[str, Policy]:
    """The registered policies by model class name (the registry itself)."""
    return _POLICIES


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Set the submodule at dotted ``name`` of ``root`` to ``new``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def swap(
    root: nn.Module, name: str, make: Callable[[nn.Module], nn.Module], replaced: dict[int, nn.Parameter]
) -> nn.Module:
    """Replace the submodule ``name`` by ``make(old)``, recording old -> new parameters by name.
    A LoRA layer (``tessera.lora``) stays, its base replaced and its adapter split with it."""
    old = root.get_submodule(name)
    rebase = getattr(old, "rebase", None)
    if rebase is not None:
        inner = old.get_submodule("base_layer")
        replaced.update(rebase(make))  # type: ignore[arg-type]
        _record(inner, old.get_submodule("base_layer"), replaced)
        return old
    new = make(old)
    _record(old, new, replaced)
    replace_module(root, name, new)
    return new


def _record(old: nn.Module, new: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    before = dict(old.named_parameters(recurse=False))
    for pname, param in new.named_parameters(recurse=False):
        if pname in before and before[pname] is not param:
            replaced[id(before[pname])] = param
            param.requires_grad_(before[pname].requires_grad)  # a frozen weight stays frozen split


def retie(root: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    """Point every module of ``root`` still holding a replaced parameter at its replacement, so
    that a parameter shared by two modules (BERT's ``cls.predictions.bias`` is its decoder's
    bias) stays one parameter after one of them was swapped."""
    for module in root.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            new = replaced.get(id(param))
            if new is not None and new is not param:
                setattr(module, name, new)


def divides(what: str, count: int, size: int) -> list[str]:
    """The rule ``count % size == 0`` as a message when broken."""
    return [] if count % size == 0 else [f"{what} ({count}) must be divisible by the tensor size ({size})"]
