"""``tessera.memory.host`` on CPU: plain host copies, converted, never aliasing their source;
pinning is for CUDA devices only (the pinned, non-blocking paths run in the CUDA lane)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.memory import copy_to_device_, host_copy, pins_for, wait_for_device


def test_only_cuda_devices_exchange_pinned_buffers():
    assert pins_for(torch.device("cuda", 0))
    assert not pins_for(torch.device("cpu"))
    assert not pins_for(torch.device("meta"))


@pytest.mark.parametrize("wait", [True, False])
def test_host_copy_converts_and_does_not_alias_its_source(wait):
    source = torch.randn(4, 5).to(torch.bfloat16)
    copy = host_copy(source, torch.float32, wait=wait)
    assert (copy.device.type, copy.dtype, copy.shape) == ("cpu", torch.float32, source.shape)
    assert not copy.is_pinned()
    torch.testing.assert_close(copy, source.float(), rtol=0, atol=0)
    source.zero_()
    assert copy.abs().sum() > 0, "the copy is its own storage"


def test_host_copy_of_a_parameter_keeps_its_dtype_and_no_grad():
    param = nn.Parameter(torch.randn(3, 2))
    copy = host_copy(param)
    assert copy.dtype == torch.float32 and not copy.requires_grad
    assert copy.data_ptr() != param.data_ptr()
    torch.testing.assert_close(copy, param.detach(), rtol=0, atol=0)


def test_copy_to_device_writes_every_destination_in_its_dtype():
    destinations = [torch.zeros(6, dtype=torch.bfloat16), torch.zeros(2, 3)]
    sources = [torch.arange(6.0), torch.full((2, 3), 0.5)]
    copy_to_device_(destinations, sources)
    wait_for_device(torch.device("cpu"))
    assert destinations[0].dtype == torch.bfloat16
    torch.testing.assert_close(destinations[0].float(), sources[0], rtol=0, atol=0)
    torch.testing.assert_close(destinations[1], sources[1], rtol=0, atol=0)


def test_copy_to_device_into_views_of_a_parameter_needs_no_grad_mode():
    flat = nn.Parameter(torch.zeros(8))
    copy_to_device_([flat[:4], flat[4:]], [torch.ones(4), torch.full((4,), 2.0)])
    assert flat.detach().tolist() == [1.0] * 4 + [2.0] * 4


def test_copy_to_device_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        copy_to_device_([torch.zeros(1), torch.zeros(1)], [torch.ones(1)])
    copy_to_device_([], [])  # nothing to copy
