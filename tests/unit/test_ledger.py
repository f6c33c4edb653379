"""The comm ledger's arithmetic and the boundary that keeps collectives inside tessera/comm."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from tessera.comm import ledger, logical_bytes
from tessera.comm.ledger import record

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"

COLLECTIVES = (
    "all_reduce|all_gather|all_gather_single|all_gather_into_tensor|reduce_scatter|reduce_scatter_single|"
    "reduce_scatter_tensor|broadcast|broadcast_object_list|send|recv|isend|irecv|all_to_all|all_to_all_single|"
    "batch_isend_irecv|reduce|gather|scatter|barrier|all_gather_object"
)
CALL = re.compile(rf"\b(?:torch\.distributed|dist|c10d)\.({COLLECTIVES})\s*\(")
IMPORT = re.compile(rf"from\s+torch\.distributed(?:\.distributed_c10d)?\s+import\s+[^\n]*\b({COLLECTIVES})\b")


def raw_collective_calls(root: Path) -> list[str]:
    """Lines under ``root`` (outside comm/) that call a torch.distributed collective directly."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        if "comm" in path.relative_to(root).parts[:1]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CALL.search(line) or IMPORT.search(line):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def test_no_collective_outside_comm():
    assert raw_collective_calls(PACKAGE) == []


def test_the_boundary_check_catches_a_raw_call(tmp_path):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "ok.py").write_text("dist.all_reduce(t)\n")
    (tmp_path / "layer.py").write_text("import torch.distributed as dist\nx = dist.all_reduce(t, group=g)\n")
    (tmp_path / "other.py").write_text("from torch.distributed import broadcast\n")
    (tmp_path / "fine.py").write_text("dist.get_rank()\nmy.all_reduce(t)\n")
    assert raw_collective_calls(tmp_path) == [
        "layer.py:2: x = dist.all_reduce(t, group=g)",
        "other.py:1: from torch.distributed import broadcast",
    ]


@pytest.mark.parametrize(
    ("op", "n", "p", "expected"),
    [
        ("all_reduce", 4000, 4, Fraction(6000)),
        ("all_reduce", 4000, 3, Fraction(16000, 3)),
        ("all_gather", 128, 4, Fraction(96)),
        ("reduce_scatter", 128, 2, Fraction(64)),
        ("broadcast", 40, 4, Fraction(30)),
        ("reduce", 40, 2, Fraction(20)),
        ("all_to_all", 64, 8, Fraction(56)),
        ("send", 16, 4, Fraction(16)),
        ("recv", 16, 4, Fraction(16)),
        ("barrier", 0, 4, Fraction(0)),
        ("all_reduce", 4000, 1, Fraction(0)),
    ],
)
def test_logical_bytes_formulas(op, n, p, expected):
    assert logical_bytes(op, n, p) == expected


def test_ledger_sums_and_filters():
    with ledger() as outer:
        record("all_reduce", "tensor", 4, 4000)
        with ledger() as inner:
            record("all_gather", "data", 2, 100)
            record("all_reduce", "tensor", 4, 400)
        record("all_reduce", "data", 3, 30)
    record("all_reduce", "tensor", 4, 10_000)  # no ledger open: not counted anywhere
    assert outer.bytes("all_reduce", "tensor") == 6000 + 600
    assert outer.calls("all_reduce") == 3 and outer.calls() == 4
    assert outer.bytes("all_reduce", "data") == 40  # 2 * (3-1)/3 * 30
    assert outer.bytes() == 6600 + 50 + 40
    assert inner.bytes() == 650 and inner.payload_bytes() == 500
    assert outer.summary()[("all_gather", "data")] == {"calls": 1, "bytes": 50, "payload_bytes": 100}
    with pytest.raises(ValueError, match="unknown comm op"):
        logical_bytes("allreduce", 1, 2)
