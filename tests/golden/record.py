"""The golden file format and its comparison: bitwise within a recorded numerics class, within a
measured tolerance across classes.

A golden file is JSON: what produced it, the run's definition, and the run's numbers once per
numerics class it was recorded in (``tests/golden/numerics.py``: torch build x ATen's kernel class
x a fingerprint of the BLAS/oneDNN paths). Floats are ``float.hex()`` strings so that the
comparison can be exact; each weight tensor is stored as the SHA-256 of its bytes plus the exactly
rounded sum, sum of squares and projection on a fixed random vector of its values (``math.fsum``,
independent of summation order).

The check: on a machine whose class is recorded, the numbers must equal that class's bit for bit
(any change of numerics fails, one ulp included). On a machine of a class that is not recorded,
every number must lie within the file's tolerance of the anchor class's: the largest difference
measured between the recorded classes, times :data:`MARGIN`, and never below :data:`FLOOR_ULPS`
units in the last place of float32 (the losses, norms and master weights are float32 in every run,
bf16 included). The run is then computed twice and the two must agree bit for bit, so
that non-determinism is still caught where only a tolerance applies across machines.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CURVES = Path(__file__).resolve().parent / "curves"
REGENERATE = "python -m tests.golden.regenerate"  # from the repository root
FORMAT = 2
MARGIN = 10.0  # tolerance = MARGIN x the largest difference measured between recorded classes
FLOOR_ULPS = 16  # ... and at least this many units in the last place of float32
_PROJECTION_SEED = 20261127


def hex_floats(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


def _projection(n: int) -> list[float]:
    g = torch.Generator().manual_seed(_PROJECTION_SEED)
    return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).tolist()


def weights_fingerprint(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per tensor: dtype, shape, SHA-256 of its bytes, and hex of the sum, the sum of squares and
    the projection on a fixed random vector in [-1, 1) of its values (exactly rounded)."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        values = tensor.double().reshape(-1).tolist()  # float32 and bf16 values are exact in float64
        out[key] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "sha256": hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "sum": math.fsum(values).hex(),
            "sumsq": math.fsum(v * v for v in values).hex(),  # a float32 squared is exact in float64
            "proj": math.fsum(v * r for v, r in zip(values, _projection(len(values)))).hex(),
        }
    return out


def golden_path(name: str) -> Path:
    return CURVES / f"{name}.json"


def read_golden(name: str) -> dict[str, Any] | None:
    path = golden_path(name)
    return json.loads(path.read_text()) if path.exists() else None


# -- differences between two sets of numbers ------------------------------------------------------


def _rel(a: str, b: str) -> float:
    x, y = float.fromhex(a), float.fromhex(b)
    return abs(x - y) / max(abs(y), 1e-30) if x != y else 0.0


def series_deviations(got: list[str], anchor: list[str]) -> list[float]:
    """Relative difference at each step (``got`` and ``anchor`` of the same length)."""
    return [_rel(g, a) for g, a in zip(got, anchor)]


def tensor_deviation(got: dict[str, Any], anchor: dict[str, Any]) -> float:
    """How far one weight tensor moved, relative to its size: the differences of its sum and
    projection over ``sqrt(n) * |w|`` (their bound by Cauchy-Schwarz for a relative change of
    ``|w|``) and of its sum of squares over ``2 |w|^2``; the largest of the three."""
    if got["sha256"] == anchor["sha256"]:
        return 0.0
    n = math.prod(anchor["shape"])
    sumsq = float.fromhex(anchor["sumsq"])
    norm = math.sqrt(sumsq)
    if norm == 0.0:
        return math.inf if float.fromhex(got["sumsq"]) != 0.0 else 0.0
    scale = math.sqrt(n) * norm
    return max(
        abs(float.fromhex(got["sum"]) - float.fromhex(anchor["sum"])) / scale,
        abs(float.fromhex(got["proj"]) - float.fromhex(anchor["proj"])) / scale,
        abs(float.fromhex(got["sumsq"]) - sumsq) / (2 * sumsq),
    )


def deviations(got: dict[str, Any], anchor: dict[str, Any]) -> dict[str, float]:
    """The largest deviation of each series and of the weights (0.0 where equal)."""
    out = {}
    for key, value in anchor.items():
        if key == "final_weights":
            out[key] = max((tensor_deviation(got[key][k], v) for k, v in value.items()), default=0.0)
        else:
            out[key] = max(series_deviations(got[key], value), default=0.0)
    return out


def tolerance_of(classes: dict[str, Any], anchor: str) -> dict[str, Any]:
    """The cross-class tolerance of a run: per quantity, MARGIN x the largest deviation measured
    from the anchor class among the recorded classes, at least FLOOR_ULPS of float32."""
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps
    measured: dict[str, float] = {}
    for name, numbers in classes.items():
        if name == anchor:
            continue
        for key, value in deviations(numbers, classes[anchor]).items():
            measured[key] = max(measured.get(key, 0.0), value)
    keys = classes[anchor].keys()
    return {
        "margin": MARGIN,
        "floor": floor,
        "measured": {k: measured.get(k, 0.0) for k in keys},
        "allowed": {k: max(MARGIN * measured.get(k, 0.0), floor) for k in keys},
    }


# -- writing --------------------------------------------------------------------------------------


def write_golden(
    name: str,
    definition: dict[str, Any],
    numbers: dict[str, Any],
    produced_by: str,
    numerics: str,
    keep_classes: bool,
) -> Path:
    """Record ``numbers`` as class ``numerics`` of run ``name``. With ``keep_classes`` the file's
    other classes stay (recording one more class of the same numerics); otherwise they are
    dropped (a change of numerics makes them stale). The tolerance is measured anew."""
    old = read_golden(name)
    classes: dict[str, Any] = {}
    anchor = numerics
    if keep_classes and old is not None and old.get("format") == FORMAT and old["definition"] == definition:
        classes = dict(old["classes"])
        anchor = old["anchor"]
    classes[numerics] = numbers
    record = {
        "format": FORMAT,
        "run": name,
        "device": "cpu (gloo, one intra-op thread per rank)",
        "produced_by": produced_by,
        "note": "Golden numbers per numerics class (bitwise within a class); floats are float.hex(). Do not "
        f"edit by hand: `{REGENERATE} {name}` after an intended change of numerics (docs/testing.md).",
        "definition": definition,
        "anchor": anchor,
        "tolerance": tolerance_of(classes, anchor),
        "classes": classes,
    }
    path = golden_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


# -- checking -------------------------------------------------------------------------------------


def _regenerate_hint(name: str) -> str:
    return (
        f"If this change of numerics is intended, regenerate and commit the golden file:\n"
        f"    {REGENERATE} {name}\n"
        f"(writes {golden_path(name).relative_to(CURVES.parents[2])}; see docs/testing.md, 'Golden loss curves')."
    )


def _fmt(h: str) -> str:
    return f"{h} ({float.fromhex(h)!r})"


def _where(i: int, n: int) -> str:
    return f"step {i + 1} of {n}" if n > 1 else "its only value"


def _curve_problem(what: str, expected: list[str], got: list[str], allowed: float | None) -> str | None:
    if len(expected) != len(got):
        return f"{what}: {len(got)} steps, the golden file has {len(expected)}"
    if allowed is None:
        differ = [i for i, (e, g) in enumerate(zip(expected, got)) if e != g]
        if not differ:
            return None
        first = differ[0]
        return (
            f"{what} differs first at {_where(first, len(expected))}: expected {_fmt(expected[first])}, "
            f"got {_fmt(got[first])} ({len(differ)} of {len(expected)} differ)"
        )
    devs = series_deviations(got, expected)
    over = [i for i, d in enumerate(devs) if d > allowed]
    if not over:
        return None
    first = over[0]
    return (
        f"{what} leaves the tolerance first at {_where(first, len(expected))}: expected {_fmt(expected[first])}, "
        f"got {_fmt(got[first])}, relative difference {devs[first]:.3g} > allowed {allowed:.3g} "
        f"({len(over)} of {len(expected)} steps outside)"
    )


def _weights_problem(expected: dict[str, Any], got: dict[str, Any], allowed: float | None) -> str | None:
    if expected.keys() != got.keys():
        return f"final weights: keys differ (missing {sorted(expected.keys() - got.keys())}, extra {sorted(got.keys() - expected.keys())})"
    for key in expected:
        e, g = expected[key], got[key]
        if (e["dtype"], e["shape"]) != (g["dtype"], g["shape"]):
            return f"final weights: {key!r} is {g['dtype']} {g['shape']}, the golden file has {e['dtype']} {e['shape']}"
    if allowed is None:
        differ = [k for k in expected if expected[k] != got[k]]
        verdict = f"final weights differ in {len(differ)} of {len(expected)} tensors"
    else:
        devs = {k: tensor_deviation(got[k], expected[k]) for k in expected}
        differ = [k for k in expected if devs[k] > allowed]
        verdict = f"final weights leave the tolerance in {len(differ)} of {len(expected)} tensors" + (
            f" (relative deviation of the first {devs[differ[0]]:.3g} > allowed {allowed:.3g})" if differ else ""
        )
    if not differ:
        return None
    e, g = expected[differ[0]], got[differ[0]]
    return (
        f"{verdict}, first {differ[0]!r}: expected sum {_fmt(e['sum'])} sumsq {_fmt(e['sumsq'])} "
        f"sha256 {e['sha256'][:16]}..., got sum {_fmt(g['sum'])} sumsq {_fmt(g['sumsq'])} sha256 {g['sha256'][:16]}..."
    )


def problems(expected: dict[str, Any], got: dict[str, Any], allowed: dict[str, float] | None) -> list[str]:
    """What differs between two sets of numbers: bitwise (``allowed`` None) or per quantity within
    ``allowed[key]``. An empty list when they agree."""
    out = []
    for key, value in expected.items():
        if key not in got:
            out.append(f"{key}: in the golden file but not computed")
        elif key == "final_weights":
            out.append(_weights_problem(value, got[key], None if allowed is None else allowed[key]))
        else:
            out.append(_curve_problem(key, value, got[key], None if allowed is None else allowed[key]))
    out += [f"{key}: computed but not in the golden file" for key in got if key not in expected]
    return [p for p in out if p is not None]


def check_against_golden(name: str, definition: dict[str, Any], compute: Callable[[], tuple[str, dict]]) -> None:
    """Fail (AssertionError) unless the numbers of run ``name`` match the golden file: bit for bit
    where their numerics class is recorded, otherwise within the file's cross-class tolerance and
    bitwise equal when computed again. ``compute()`` returns ``(numerics class, numbers)``."""
    __tracebackhide__ = True  # the message says it all; pytest need not print the numbers
    golden = read_golden(name)
    if golden is None:
        raise AssertionError(f"golden run {name!r}: no golden file {golden_path(name)}.\n{_regenerate_hint(name)}")
    if golden.get("format") != FORMAT:
        raise AssertionError(
            f"golden run {name!r}: the file has format {golden.get('format')}, this is {FORMAT}.\n{_regenerate_hint(name)}"
        )
    if golden["definition"] != definition:
        raise AssertionError(
            f"golden run {name!r}: the run's definition changed since the golden file was written:\n"
            f"    golden: {golden['definition']}\n    now:    {definition}\n{_regenerate_hint(name)}"
        )
    numerics, numbers = compute()
    recorded = numerics in golden["classes"]
    if recorded:
        found = problems(golden["classes"][numerics], numbers, None)
        how = f"numerics class {numerics!r} (recorded: compared bit for bit)"
    else:
        found = problems(golden["classes"][golden["anchor"]], numbers, golden["tolerance"]["allowed"])
        how = (
            f"numerics class {numerics!r} (not recorded; compared with class {golden['anchor']!r} within "
            f"{golden['tolerance']['margin']:g}x the largest difference measured between the "
            f"{len(golden['classes'])} recorded classes)"
        )
        if not found:
            again = problems(numbers, compute()[1], None)
            found = [f"not deterministic: computed twice, {p}" for p in again]
    if found:
        raise AssertionError(
            f"golden run {name!r}, {how}, does not reproduce its golden numbers:\n  - "
            + "\n  - ".join(found)
            + f"\n{_regenerate_hint(name)}"
        )
