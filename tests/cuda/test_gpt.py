"""A short tiny-GPT run on the GPU gives the CPU run's answer (fp32 to summation-order rounding,
bf16 within what bf16 allows), and one-rank ZeRO on the GPU gives the plain engine's."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.runs import assert_same_run, gpt_config, train_gpt

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cpu_fp32():
    return train_gpt(CPU, gpt_config("fp32"))


def test_fp32_on_the_device_matches_the_cpu_run(device, cpu_fp32):
    got = train_gpt(device, gpt_config("fp32"))
    assert got[2].ctx.device == device
    assert all(p.device == device for p in got[2].module.parameters())
    # fp32 on two devices: the same arithmetic in another summation order, over 10 Adam steps
    assert_same_run(got, cpu_fp32, rtol=1e-4, atol=1e-5)


def test_bf16_on_the_device_tracks_the_fp32_cpu_run(device, cpu_fp32):
    got = train_gpt(device, gpt_config("bf16"))
    assert_same_run(got, cpu_fp32, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_zero_on_the_device_matches_the_plain_engine(device, stage):
    plain = train_gpt(device, gpt_config("fp32"))
    got = train_gpt(device, gpt_config("fp32", stage=stage))
    assert_same_run(got, plain, rtol=1e-5, atol=1e-6)
