"""Golden loss curve of the default ``tessera train`` run (first 20 steps): losses, learning
rates, the final evaluation and the written weights must equal tests/golden/curves/ bit for bit
where this machine's numerics class is recorded, within the measured tolerance elsewhere."""

from __future__ import annotations

import itertools

from tests.golden import default_train
from tests.golden.record import check_against_golden


def test_default_train_run_reproduces_its_golden_numbers(tmp_path):
    runs = itertools.count()
    check_against_golden(
        default_train.NAME, default_train.definition(), lambda: default_train.compute(tmp_path / f"run{next(runs)}")
    )
