"""The strategy interface has no dead methods, and a strategy around another forwards every
method it does not define itself: a pipeline's ``report``, ``close`` and ``checkpoint_groups``
reach its inner strategy."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from tessera.context.views import HeldTensor, whole_view
from tessera.parallel.pipeline.strategy import PipelineParallel
from tessera.parallel.strategy import Strategy, WrappingStrategy, interface_methods

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"
INTERFACE = PACKAGE / "parallel" / "strategy.py"


def library_callers(name: str) -> list[str]:
    """Where the library (benchmarks left out) calls the interface method ``name``: through a
    strategy (``strategy.name``, ``engine.strategy.name``), or from the interface's own defaults."""
    through_strategy = re.compile(rf"\bstrategy\.{name}\b")
    from_defaults = re.compile(rf"\bself\.{name}\(")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bench" in path.relative_to(PACKAGE).parts:
            continue
        text = path.read_text()
        if through_strategy.search(text) or (path == INTERFACE and from_defaults.search(text)):
            found.append(str(path.relative_to(PACKAGE)))
    return found


def test_every_method_of_the_interface_has_a_caller_in_the_library():
    names = interface_methods()
    assert {"close", "report", "checkpoint_groups", "forward", "step"} <= set(names)
    assert "memory_parts" not in names and "state_dict" not in names  # what had no caller went
    uncalled = [name for name in names if not library_callers(name)]
    assert uncalled == [], f"interface methods that nothing in tessera/ calls: {uncalled}"
    assert library_callers("close") and library_callers("report")
    assert library_callers("no_such_method") == []  # the search finds nothing where nothing is


class Recording(Strategy):
    """An inner strategy that records the calls it gets."""

    name = "recording"

    def __init__(self) -> None:
        self.module = self.model = nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.ctx = SimpleNamespace()
        self.calls: list[str] = []
        self.opened = 0

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")

    def holds(self, param: torch.Tensor) -> bool:
        self.calls.append("holds")
        return True

    def report(self) -> dict[str, int]:
        self.calls.append("report")
        return {"chunks": 3}

    def close(self) -> None:
        self.calls.append("close")

    def checkpoint_tensors(self) -> list[HeldTensor]:
        return [HeldTensor(key, p, whole_view(p.shape)) for key, p in self.module.named_parameters()]

    def checkpoint_groups(self):
        @contextmanager
        def group():
            self.opened += 1
            yield self.checkpoint_tensors()
            self.opened -= 1

        return [group()]


def test_a_wrapping_strategy_forwards_every_method_it_does_not_define():
    class Around(WrappingStrategy):
        def __init__(self, inner: Strategy) -> None:
            self.inner = inner

    inner = Recording()
    around = Around(inner)
    for name in interface_methods():
        assert getattr(Around, name).__doc__ == getattr(Strategy, name).__doc__
    around.zero_grad()
    around.close()
    assert around.report() == {"chunks": 3}
    assert around.holds(inner.module.weight) is True
    assert inner.calls == ["zero_grad", "close", "report", "holds"]


def test_a_pipeline_stage_forwards_report_close_and_its_own_checkpoint_groups():
    inner = Recording()
    weight, bias = inner.module.weight, inner.module.bias
    stage = SimpleNamespace(microbatches=2, schedule="1f1b", parameters=[weight])  # this stage trains the weight
    pipeline = PipelineParallel(stage, inner)
    assert pipeline.report() == {"chunks": 3}
    pipeline.close()
    assert inner.calls == ["report", "close"]
    [group] = pipeline.checkpoint_groups()
    with group as held:
        assert inner.opened == 1, "the inner strategy's group is open while its tensors are read"
        assert [h.key for h in held] == ["weight"], "another stage's parameter is not this stage's to save"
        assert held[0].tensor is weight and bias is not held[0].tensor
    assert inner.opened == 0
    assert [h.key for h in pipeline.checkpoint_tensors()] == ["weight"]
