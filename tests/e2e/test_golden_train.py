"""Golden loss curve of the default ``tessera train`` run (first 20 steps): losses, learning
rates, the final evaluation and the written weights must equal tests/golden/curves/ bit for bit."""

from __future__ import annotations

from tests.golden import default_train
from tests.golden.record import check_against_golden


def test_default_train_run_reproduces_its_golden_numbers(tmp_path):
    numbers = default_train.compute(tmp_path / "run")
    check_against_golden(default_train.NAME, default_train.definition(), numbers)
