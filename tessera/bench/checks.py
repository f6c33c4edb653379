"""What benches check of their sides before reporting them: that every rank built a side, that
an anchor trains the same model as tessera (its loss trajectory close to tessera's), and that
two generators produce the same greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def agreed(ok: bool, group: Any) -> bool:
    """Whether every rank of ``group`` says ``ok`` (a collective)."""
    from tessera import comm

    flag = torch.tensor([0.0 if ok else 1.0])
    comm.all_reduce(flag, group, op="max")
    return bool(flag.item() == 0.0)


def built_sides(
    builders: dict[str, Callable[[], T]], group: Any, required: Callable[[str], bool]
) -> tuple[dict[str, T], dict[str, str]]:
    """Each side built, in order, and the reasons of those left out: an anchor that fails to build
    on any rank of ``group`` (it cannot run here) is left out on every rank, with its error (or
    "failed on another rank"); a ``required`` side's failure (tessera's own) raises. Collective."""
    built: dict[str, T] = {}
    errors: dict[str, str] = {}
    for label, build in builders.items():
        error = None
        try:
            built[label] = build()
        except Exception as exc:  # an anchor that cannot run here: its rows are absent, the reason printed
            if required(label):
                raise
            error = f"{type(exc).__name__}: {exc}"
        if not agreed(error is None, group):
            built.pop(label, None)
            errors[label] = error or "failed on another rank"
    return built, errors


def loss_gaps(losses: dict[str, list[float]], reference: str, first_rtol: float, rtol: float) -> dict[str, float]:
    """Each other side's largest relative loss difference from ``reference``'s over the steps;
    raises when a side's first step differs by more than ``first_rtol`` or any step by more
    than ``rtol`` (it trains something else)."""
    ours = losses[reference]
    worst: dict[str, float] = {}
    for label, theirs in losses.items():
        if label == reference:
            continue
        if len(theirs) != len(ours):
            raise RuntimeError(f"{label} took {len(theirs)} steps, {reference} {len(ours)}")
        diffs = [abs(a - b) / abs(a) for a, b in zip(ours, theirs, strict=True)]
        if diffs[0] > first_rtol or max(diffs) > rtol:
            raise RuntimeError(
                f"{label} trains something else than {reference}: first-step losses {theirs[0]} and {ours[0]} "
                f"(relative difference {diffs[0]:.2e}, allowed {first_rtol}), largest difference over "
                f"{len(diffs)} steps {max(diffs):.2e} (allowed {rtol})"
            )
        worst[label] = max(diffs)
    return worst


def same_tokens(batch: int, tokens: dict[str, list[list[int]]], ours: str, theirs: str) -> None:
    """Raises unless sides ``ours`` and ``theirs`` generated the same greedy tokens for every
    prompt of the batch, naming the first difference (their speeds are compared only then)."""
    for i, (a, b) in enumerate(zip(tokens[ours], tokens[theirs], strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise RuntimeError(
                f"batch {batch}, prompt {i}: {ours} and {theirs} generate different greedy tokens from token "
                f"{at} ({a[at : at + 3]} against {b[at : at + 3]}), so their speeds cannot be compared"
            )


def fresh_deepspeed() -> None:
    """Forget the parallel groups an earlier DeepSpeed side left in DeepSpeed's module globals.
    A pool's ranks outlive a bench: after AutoTP's side (tensor groups of 2) the next
    ``deepspeed.initialize`` on the same rank would take that model-parallel state for its own
    and fail. The process groups themselves stay (torch owns them); only DeepSpeed's references go."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if callable(release):
        release(None)
    else:  # older DeepSpeed: the globals that say a model-parallel layout is set
        groups.mpu = None
