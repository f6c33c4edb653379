"""``tessera.memory.host`` on the device: host copies land in pinned memory, and the copies in
both directions return before the device has done them."""

from __future__ import annotations

import torch

from tessera.memory import copy_to_device_, host_copy, pins_for, wait_for_device
from tests.cuda.lane import keep_stream_busy, stream_finished


def test_host_copy_of_a_device_tensor_is_pinned_and_converted(device):
    x = torch.randn(1000, device=device).to(torch.bfloat16)
    copy = host_copy(x, torch.float32)
    assert (copy.device.type, copy.dtype, copy.shape) == ("cpu", torch.float32, x.shape)
    assert copy.is_pinned() == pins_for(device)
    torch.testing.assert_close(copy, x.float().cpu(), rtol=0, atol=0)


def test_a_copy_to_the_host_without_wait_does_not_block(device):
    x = torch.randn(1 << 20, device=device)
    keep_stream_busy(device)
    copy = host_copy(x, wait=False)
    # on the device, the copy waits behind the busy kernel while the host goes on
    assert stream_finished(device) == (device.type != "cuda")
    wait_for_device(device)
    assert stream_finished(device)
    torch.testing.assert_close(copy, x.cpu(), rtol=0, atol=0)


def test_a_copy_from_pinned_memory_to_the_device_does_not_block(device):
    sources = [host_copy(torch.randn(1 << 18, device=device)) for _ in range(3)]
    destinations = [torch.zeros(1 << 18, dtype=torch.bfloat16, device=device) for _ in sources]
    keep_stream_busy(device)
    copy_to_device_(destinations, sources)
    assert stream_finished(device) == (device.type != "cuda")
    wait_for_device(device)
    for d, s in zip(destinations, sources):
        torch.testing.assert_close(d.cpu(), s.to(torch.bfloat16), rtol=0, atol=0)
