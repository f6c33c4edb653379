"""Which rank writes which piece of a save.

The ranks exchange descriptions of what they hold (a few hundred bytes per tensor, as JSON) and
every rank works out the same plan: each distinct piece (name and view) is written once, by the
holder with the fewest bytes assigned so far, largest pieces first, so replicas share the
writing.

Saving the same tensors again costs no new plan: each rank keeps its *share* of the last plan
(which of its pieces it writes, and the host buffer asynchronous saves copy them into), checks
that it holds the same pieces (names, views, dtypes, shapes) and the ranks agree on that in one
all-reduce of one integer; if any rank's pieces changed, every rank plans anew.

A blocking save agrees before it writes (:func:`share`). An asynchronous save must not wait for
the other ranks while training waits, so each rank decides alone, copies what that decision
needs (its kept share, or, without one, everything it holds) and returns; the background
writers then agree over a process group of their own (:func:`settle`). When every rank kept its
share, that is the plan; otherwise they exchange what they hold and what they copied, and plan
among the ranks that copied each piece (the balanced plan is kept for the next save).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from tessera import comm
from tessera.checkpoint.format import CheckpointError, dtype_name
from tessera.checkpoint.holding import Signature
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.views import View

PlanKey = tuple[Any, ...]


def exchange(data: Any, group: AxisGroup | None, device: torch.device) -> list[Any]:
    """Every rank's ``data`` (JSON), in rank order (collective over ``group``; no pickling)."""
    if group is None or group.size == 1:
        return [data]
    payload = json.dumps(data, separators=(",", ":")).encode()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = comm.all_gather(length, group).tolist()
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = comm.all_gather(buffer.to(device), group).cpu().view(group.size, -1)
    return [json.loads(bytes(gathered[r, :n].numpy())) for r, n in enumerate(lengths)]


def describe(name: str, view: View, dtype: torch.dtype, shape: torch.Size) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(view.full_shape),
        "dtype": dtype_name(dtype),
        "view": view.to_json(),
        "nbytes": shape.numel() * dtype.itemsize,
    }


def plan_key(name: str, view: dict[str, Any]) -> PlanKey:
    """A distinct piece: its name and (the JSON of) its view, hashable."""
    flat = view["flat"]
    return (name, tuple(view["local_shape"]), repr(view["segments"]), tuple(flat) if flat is not None else None)


def plan(described: list[list[dict[str, Any]]], only_copied: bool = False) -> dict[PlanKey, int]:
    """Which rank writes each distinct piece: the holder with the fewest bytes assigned so far,
    largest pieces first (the same answer on every rank). ``only_copied``: only among holders
    whose description says ``"copied": true``; a piece no such holder has is an error."""
    holders: dict[PlanKey, list[int]] = {}
    sizes: dict[PlanKey, int] = {}
    for rank, pieces in enumerate(described):
        for p in pieces:
            key = plan_key(p["name"], p["view"])
            rank_list = holders.setdefault(key, [])
            if not only_copied or p.get("copied"):
                rank_list.append(rank)
            sizes[key] = p["nbytes"]
    missing = sorted(key[0] for key, ranks in holders.items() if not ranks)
    if missing:
        raise CheckpointError(
            f"{len(missing)} piece(s) were copied by no rank that holds them ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): the ranks' tensors changed between saves in different "
            "ways; the next save plans anew on every rank"
        )
    load = [0] * len(described)
    out: dict[PlanKey, int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], repr(k))):
        writer = min(holders[key], key=lambda r: (load[r], r))
        out[key] = writer
        load[writer] += sizes[key]
    return out


def _mine(plan_: dict[PlanKey, int], signature: Signature, rank: int) -> list[tuple[str, int]]:
    """(key in this rank's file, index of the piece) of the pieces ``plan_`` gives ``rank``."""
    return [
        (f"{name}@{rank}.{n}", n)
        for n, (name, view, _, _) in enumerate(signature)
        if plan_[plan_key(name, view.to_json())] == rank
    ]


@dataclass
class Share:
    """A rank's share of a save, kept for the next save while what every rank holds is the same:
    the ``signature`` of this rank's pieces, the ``keys`` (key in this rank's file, index of the
    piece) of the pieces it writes, and the host buffer asynchronous saves copy them into."""

    ctx: ParallelContext
    signature: Signature
    keys: list[tuple[str, int]]
    staging: Any = None  # a tessera.checkpoint.background.Staging

    def __post_init__(self) -> None:
        self.indices = [n for _, n in self.keys]  # of the pieces this rank writes


_kept: list[Share] = []  # the last share (one engine saved repeatedly is the common case)


def kept_share(signature: Signature, ctx: ParallelContext) -> Share | None:
    """The kept share if this rank holds what it held then (not yet agreed with the others)."""
    if _kept and _kept[0].ctx is ctx and _kept[0].signature == signature:
        _kept[0].signature = signature  # equal; the same objects make the next comparison quick
        return _kept[0]
    return None


def forget() -> None:
    """Plan anew at the next save (on every rank: each calls this at the same point)."""
    _kept.clear()


class _Agreement:
    """The ranks' answer to "does every kept share still hold?", under way; :meth:`wait` gives it
    (and raises, naming them, if any rank said it could not take part)."""

    def __init__(self, future: Any, group: AxisGroup, failed: str | None) -> None:
        self.future, self.group, self.failed = future, group, failed

    def wait(self) -> bool:
        got = self.future.wait().tolist()
        if got[1]:
            ranks = [r for r in range(self.group.size) if got[2 + r]]
            reason = f" ({self.failed})" if self.failed is not None else ""
            raise CheckpointError(f"rank(s) {ranks} could not take part in the save{reason}")
        return got[0] == 0


def _agreed(kept: Share | None, group: AxisGroup, device: torch.device, failed: str | None = None) -> _Agreement:
    """Start asking every rank whether its kept share still holds (collective: a few integers).
    ``failed``: this rank cannot take part (why); every rank's answer then raises."""
    flags = [0 if kept is not None else 1, int(failed is not None)] + [0] * group.size
    if failed is not None:
        flags[2 + group.rank] = 1
    tensor = torch.tensor(flags, dtype=torch.int64, device=device)
    return _Agreement(comm.all_reduce_async(tensor, group), group, failed)


def start_agreeing(signature: Signature, ctx: ParallelContext) -> tuple[Share | None, Any]:
    """This rank's kept share (or None) and the future of the ranks' agreement on keeping theirs
    (collective over the world)."""
    kept = kept_share(signature, ctx)
    return kept, _agreed(kept, ctx.group("world"), ctx.device)


def share(signature: Signature, ctx: ParallelContext, started: Any = None) -> Share:
    """The pieces this rank writes (collective over the world). ``started``: what
    :func:`start_agreeing` returned, if already asked; when every rank's kept share holds, no
    plan is made anew."""
    kept, agreed = started if started is not None else start_agreeing(signature, ctx)
    if agreed.wait() and kept is not None:
        return kept
    forget()
    described = exchange([describe(*s) for s in signature], ctx.group("world"), ctx.device)
    made = Share(ctx, signature, _mine(plan(described), signature, ctx.rank))
    _kept.append(made)
    return made


def settle(
    signature: Signature,
    ctx: ParallelContext,
    kept: Share | None,
    copied: list[int],
    group: AxisGroup | None,
    failed: str | None = None,
) -> list[tuple[str, int]]:
    """An asynchronous save, in the background: the ranks agree (collective over ``group``, the
    writers' own) on which of the pieces each ``copied`` this rank writes; the keys and indices
    of those. Keeps the balanced plan for the next save when it changed. ``failed``: this rank
    cannot go on (why): every rank raises, none waits for it."""
    if group is None:
        if failed is not None:
            raise CheckpointError(failed)
        agreed = True
    else:
        agreed = _agreed(kept, group, torch.device("cpu"), failed).wait()  # every rank asks
    if agreed and kept is not None:
        return kept.keys
    forget()
    chosen = set(copied)
    mine = [describe(*s) | {"copied": n in chosen} for n, s in enumerate(signature)]
    described = exchange(mine, group, torch.device("cpu"))
    _kept.append(Share(ctx, signature, _mine(plan(described), signature, ctx.rank)))
    return _mine(plan(described, only_copied=True), signature, ctx.rank)
