"""The parts of a run that are not model or optimizer tensors: random states, counters,
scheduler and data position, as JSON (plus the RNG byte states, saved as tensors).

Random states are per rank: torch's CPU generator, the device's, Python's and NumPy's, and
tessera's per-axis streams (``ctx.rng``). They are restored only when the checkpoint was written
by the same layout (the same ranks play the same roles); under another layout the data order is
still restored (it depends only on the seed, the epoch and the position), the dropout masks are
new.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from typing import Any

import torch

from tessera.context import ParallelContext


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: dataclasses and mappings as objects, tuples as lists,
    tensors of one element as numbers, other tensors as lists; anything else by ``repr``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no inf or nan; float("inf") reads it back
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def restore_float(value: Any) -> Any:
    """Undo :func:`jsonable`'s text for non-finite floats."""
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def layout_of(ctx: ParallelContext) -> dict[str, Any]:
    """What identifies a layout: the axis sizes, the tensor mode and the world size."""
    return {
        "world_size": ctx.world_size,
        "sizes": {axis: ctx.size(axis) for axis in ("data", "pipeline", "sequence", "tensor")},
        "dims": jsonable(ctx.dims),
    }


# ---- random states -----------------------------------------------------------------------------


def rng_tensors(ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """This rank's generator states as byte tensors, by name."""
    out = {"cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        out["device"] = torch.cuda.get_rng_state(ctx.device)
    for axes, (cpu, dev) in ctx.rng._states.items():
        out[f"stream:{','.join(axes)}:cpu"] = cpu
        if dev is not None:
            out[f"stream:{','.join(axes)}:device"] = dev
    return out  # fresh tensors: the generators hand out copies, the streams replace theirs


def rng_states() -> tuple[Any, Any]:
    """Python's and (if present) NumPy's generator states now, as they give them (copies):
    :func:`rng_json` turns them into JSON later."""
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return random.getstate(), None
    return random.getstate(), np.random.get_state()


def rng_json(states: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Python's and (if present) NumPy's generator states (``states`` from :func:`rng_states`;
    default: now) as JSON."""
    python, numpy_state = states if states is not None else rng_states()
    version, state, gauss = python
    out: dict[str, Any] = {"python": [version, list(state), gauss]}
    if numpy_state is None:
        return out
    kind, keys, pos, has_gauss, cached = numpy_state
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return out


def restore_rng(ctx: ParallelContext, tensors: dict[str, torch.Tensor], data: dict[str, Any]) -> None:
    """Set this rank's generators from :func:`rng_tensors` and :func:`rng_json` output."""
    torch.set_rng_state(tensors["cpu"])
    if "device" in tensors and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["device"], ctx.device)
    streams: dict[tuple[str, ...], list[torch.Tensor | None]] = {}
    for name, value in tensors.items():
        if name.startswith("stream:"):
            _, axes, kind = name.split(":")
            slot = streams.setdefault(tuple(a for a in axes.split(",") if a), [None, None])
            slot[0 if kind == "cpu" else 1] = value
    ctx.rng._states = {axes: (cpu, dev) for axes, (cpu, dev) in streams.items() if cpu is not None}
    version, state, gauss = data["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in data:
        import numpy as np

        kind, keys, pos, has_gauss, cached = data["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
