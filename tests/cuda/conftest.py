"""The CUDA lane's fixtures (the lane is collected only with --cuda-lane: see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.lane import lane_device


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the lane's bodies run on: ``cuda:0`` (or TESSERA_TEST_DEVICE for a dry run)."""
    # fp32 matmuls in full precision (no TF32), so fp32 runs compare with CPU at fp32 tolerances
    torch.set_float32_matmul_precision("highest")
    return lane_device()
