"""Golden loss curves: short runs whose losses, gradient norms and final weights are stored
bit for bit in ``tests/golden/curves/`` and checked by ``tests/dist/test_golden_curves.py`` and
``tests/e2e/test_golden_train.py``. Regenerate with ``python -m tests.golden.regenerate``."""
