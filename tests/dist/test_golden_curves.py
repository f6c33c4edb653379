"""Golden loss curves, one short run per strategy: losses, gradient norms and final weights must
equal the numbers in tests/golden/curves/ bit for bit where this machine's numerics class is
recorded, and lie within the measured cross-class tolerance elsewhere (docs/testing.md, "Golden
loss curves")."""

from __future__ import annotations

import pytest

from tests.golden import strategies
from tests.golden.record import check_against_golden


@pytest.mark.parametrize("name", sorted(strategies.RUNS, key=lambda n: (strategies.RUNS[n].ranks, n)))
def test_strategy_run_reproduces_its_golden_numbers(pools, name):
    check_against_golden(name, strategies.RUNS[name].definition(), lambda: strategies.compute(pools, name))
