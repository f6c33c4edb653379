"""Benchmark rows: printing and writing them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.files import write_atomically


@dataclass(frozen=True)
class Row:
    name: str
    metric: str
    value: float
    anchor: str
    anchor_value: float

    @property
    def ratio(self) -> float:
        return self.value / self.anchor_value

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": self.ratio}


def print_rows(rows: list[Row]) -> None:
    print(f"{'name':<34} {'metric':<14} {'value':>12} {'anchor':<12} {'anchor_value':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r.name:<34} {r.metric:<14} {r.value:>12.5g} {r.anchor:<12} {r.anchor_value:>12.5g} {r.ratio:>7.3f}")


def write_rows(rows: list[Row], path: str | Path) -> None:
    write_atomically(path, json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
