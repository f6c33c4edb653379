"""The golden file format and the bitwise comparison.

A golden file is JSON: what produced it (torch version, the command), the run's definition, and
the run's numbers. Floats are stored as ``float.hex()`` strings so that the comparison is exact;
each weight tensor is stored as the SHA-256 of its bytes plus the exactly rounded sum and sum of
squares of its values (``math.fsum``, independent of summation order), which a reader can compare
by eye.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

CURVES = Path(__file__).resolve().parent / "curves"
REGENERATE = "python -m tests.golden.regenerate"  # from the repository root
FORMAT = 1


def hex_floats(values: list[float]) -> list[str]:
    return [float(v).hex() for v in values]


def weights_fingerprint(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per tensor: dtype, shape, SHA-256 of its bytes, and hex of the sum and sum of squares."""
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
        }
    return out


def golden_path(name: str) -> Path:
    return CURVES / f"{name}.json"


def write_golden(name: str, definition: dict[str, Any], numbers: dict[str, Any], produced_by: str) -> Path:
    """Write ``curves/<name>.json`` (``numbers``: lists of hex floats and a weights fingerprint)."""
    record = {
        "format": FORMAT,
        "run": name,
        "torch": torch.__version__,
        "device": "cpu (gloo, one intra-op thread per rank)",
        "produced_by": produced_by,
        "note": "Bitwise golden numbers; floats are float.hex(). Do not edit by hand: regenerate "
        f"with `{REGENERATE} {name}` when a change of numerics is intended (docs/testing.md).",
        "definition": definition,
        **numbers,
    }
    path = golden_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _regenerate_hint(name: str) -> str:
    return (
        f"If this change of numerics is intended, regenerate and commit the golden file:\n"
        f"    {REGENERATE} {name}\n"
        f"(writes {golden_path(name).relative_to(CURVES.parents[2])}; see docs/testing.md, 'Golden loss curves')."
    )


def _fmt(h: str) -> str:
    return f"{h} ({float.fromhex(h)!r})"


def _curve_problem(what: str, expected: list[str], got: list[str]) -> str | None:
    if expected == got:
        return None
    if len(expected) != len(got):
        return f"{what}: {len(got)} steps, the golden file has {len(expected)}"
    differ = [i for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    first = differ[0]
    where = f"step {first + 1} of {len(expected)}" if len(expected) > 1 else "its only value"
    return (
        f"{what} differs first at {where}: expected {_fmt(expected[first])}, "
        f"got {_fmt(got[first])} ({len(differ)} of {len(expected)} differ)"
    )


def _weights_problem(expected: dict[str, Any], got: dict[str, Any]) -> str | None:
    if expected == got:
        return None
    if expected.keys() != got.keys():
        return f"final weights: keys differ (missing {sorted(expected.keys() - got.keys())}, extra {sorted(got.keys() - expected.keys())})"
    differ = [k for k in expected if expected[k] != got[k]]
    key = differ[0]
    e, g = expected[key], got[key]
    return (
        f"final weights differ in {len(differ)} of {len(expected)} tensors, first {key!r}: "
        f"expected dtype {e['dtype']} shape {e['shape']} sum {_fmt(e['sum'])} sumsq {_fmt(e['sumsq'])} "
        f"sha256 {e['sha256'][:16]}..., got dtype {g['dtype']} shape {g['shape']} sum {_fmt(g['sum'])} "
        f"sumsq {_fmt(g['sumsq'])} sha256 {g['sha256'][:16]}..."
    )


def check_against_golden(name: str, definition: dict[str, Any], numbers: dict[str, Any]) -> None:
    """Fail (AssertionError) unless ``numbers`` equal the golden file of run ``name`` bit for bit."""
    __tracebackhide__ = True  # the message says it all; pytest need not print ``numbers``
    path = golden_path(name)
    if not path.exists():
        raise AssertionError(f"golden run {name!r}: no golden file {path}.\n{_regenerate_hint(name)}")
    golden = json.loads(path.read_text())
    if golden["torch"] != torch.__version__:
        raise AssertionError(
            f"golden run {name!r}: the golden numbers were recorded with torch {golden['torch']}, this is torch "
            f"{torch.__version__}. They are bitwise and only valid on the build that produced them (see Makefile: "
            f"torch==2.13.0, CPU). Use that build, or, when moving the project to torch {torch.__version__}, "
            f"regenerate every golden file: {REGENERATE}"
        )
    if golden["definition"] != definition:
        raise AssertionError(
            f"golden run {name!r}: the run's definition changed since the golden file was written:\n"
            f"    golden: {golden['definition']}\n    now:    {definition}\n{_regenerate_hint(name)}"
        )
    problems = []
    for key, value in numbers.items():
        if key == "final_weights":
            problem = _weights_problem(golden.get(key, {}), value)
        else:
            problem = _curve_problem(key, golden.get(key, []), value)
        if problem is not None:
            problems.append(problem)
    missing = sorted(k for k in golden if k not in numbers and k.endswith(("losses", "norms", "weights", "lrs")))
    problems += [f"{k}: in the golden file but not computed" for k in missing]
    if problems:
        raise AssertionError(
            f"golden run {name!r} no longer reproduces its golden numbers bit for bit:\n  - "
            + "\n  - ".join(problems)
            + f"\n{_regenerate_hint(name)}"
        )
