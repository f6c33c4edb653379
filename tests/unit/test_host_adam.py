"""HostAdamW gives torch.optim.AdamW's answer, over its flat buffers and fused kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.optim import HostAdamW
from tessera.optim.host_adam import fused_cpu_adamw_available
from tessera.testing import tolerance

STEPS = 20
ADAM = tolerance(depth=10 * STEPS)  # AdamW's ~10 roundings a step, in another order (fused kernels)
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def pieces(seed: int = 0) -> list[torch.Tensor]:
    """Many small 1-D pieces (the ZeRO offload case), a matrix and an empty piece."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(1, 40, (60,), generator=g)]
    out = [torch.randn(n, generator=g) for n in sizes]
    return [*out, torch.randn(5, 3, generator=g), torch.zeros(0)]


def gradients(like: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(t.shape, generator=g) for t in like]


def twins(tensors: list[torch.Tensor]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    return [nn.Parameter(t.clone()) for t in tensors], [nn.Parameter(t.clone()) for t in tensors]


def run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: range, skip=lambda step, i: False) -> None:
    for step in steps:
        for i, (p, g) in enumerate(zip(params, gradients(params, step))):
            p.grad = None if skip(step, i) else g
        opt.step()


def assert_same(params, ref):
    for i, (p, q) in enumerate(zip(params, ref)):
        torch.testing.assert_close(p.detach(), q.detach(), **ADAM, msg=f"tensor {i}")


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("kernel", [{}, {"foreach": True}, {"coalesce": False}])
def test_matches_torch_adamw_over_twenty_steps(amsgrad, kernel):
    params, ref = twins(pieces())
    opt = HostAdamW(params, **HYPER, amsgrad=amsgrad, **kernel)
    ref_opt = torch.optim.AdamW(ref, **HYPER, amsgrad=amsgrad, foreach=False)
    run(opt, params, range(STEPS))
    run(ref_opt, ref, range(STEPS))
    assert_same(params, ref)
    assert not torch.equal(params[0].detach(), pieces()[0]), "the tensors moved"


def test_kernel_choice():
    opt = HostAdamW([nn.Parameter(torch.zeros(3))])
    assert opt.defaults["fused"] is fused_cpu_adamw_available()
    assert opt.defaults["foreach"] is not fused_cpu_adamw_available()
    assert fused_cpu_adamw_available(), "torch 2.4+ has a fused AdamW for CPU"


def test_param_groups_and_tensors_without_gradients():
    params, ref = twins(pieces())

    def groups(ps):
        return [{"params": ps[:30]}, {"params": ps[30:], "lr": 3e-3, "weight_decay": 0.0}]

    def skip(step, i):  # some tensors get no gradient on some steps: AdamW leaves them alone
        return (step % 3 == 1 and i % 4 == 0) or (step == 7 and i >= 30)

    opt, ref_opt = HostAdamW(groups(params), **HYPER), torch.optim.AdamW(groups(ref), **HYPER, foreach=False)
    run(opt, params, range(STEPS), skip)
    run(ref_opt, ref, range(STEPS), skip)
    assert_same(params, ref)
    assert float(opt.state[params[0]]["step"]) == float(ref_opt.state[ref[0]]["step"]) < STEPS


def test_pieces_of_one_buffer_are_stepped_in_place():
    buffer = torch.randn(1000)
    sizes = [100, 0, 250, 650]
    views = list(buffer.split(sizes))
    params = [nn.Parameter(v) for v in views]  # share the buffer's storage
    ptrs = [p.data_ptr() for p in params]
    ref = [nn.Parameter(v.clone()) for v in views]
    opt, ref_opt = HostAdamW(params, **HYPER), torch.optim.AdamW(ref, **HYPER, foreach=False)
    assert [p.data_ptr() for p in params] == ptrs, "no copy"
    run(opt, params, range(5))
    run(ref_opt, ref, range(5))
    torch.testing.assert_close(buffer, torch.cat([r.detach() for r in ref]), **ADAM)


def test_separate_tensors_move_into_one_flat_buffer():
    params, _ = twins(pieces())
    ids = [id(p) for p in params]
    HostAdamW(params, **HYPER)
    assert [id(p) for p in params] == ids, "the same tensor objects"
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params if p.numel())
    for p, t in zip(params, pieces()):
        assert torch.equal(p.detach(), t), "values kept"


def test_gradients_accumulate_into_the_flat_buffer():
    params, ref = twins(pieces())
    opt, ref_opt = HostAdamW(params, **HYPER), torch.optim.AdamW(ref, **HYPER, foreach=False)
    for step in range(4):
        for ps, o in ((params, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            for p, g in zip(ps, gradients(ps, step)):
                (p * g).sum().backward()  # autograd accumulates into p.grad (a view after the first step)
            o.step()
    assert_same(params, ref)
    grad_views = opt._buckets[0][0].views["grad"]
    assert all(p.grad is v for p, v in zip(params, grad_views))


def test_state_dict_round_trip_with_torch_adamw():
    params, ref = twins(pieces())
    opt, ref_opt = HostAdamW(params, **HYPER), torch.optim.AdamW(ref, **HYPER, foreach=False)
    run(opt, params, range(5))
    run(ref_opt, ref, range(5))
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
    # A fresh HostAdamW from torch's state continues like torch, and torch from HostAdamW's.
    resumed, _ = twins([p.detach() for p in params])
    resumed_opt = HostAdamW(resumed, **HYPER)
    resumed_opt.load_state_dict(ref_opt.state_dict())
    ref_from_host = [nn.Parameter(p.detach().clone()) for p in params]
    ref_from_host_opt = torch.optim.AdamW(ref_from_host, **HYPER, foreach=False)
    ref_from_host_opt.load_state_dict(opt.state_dict())
    run(resumed_opt, resumed, range(5, STEPS))
    run(ref_opt, ref, range(5, STEPS))
    run(ref_from_host_opt, ref_from_host, range(5, STEPS))
    assert_same(resumed, ref)
    assert_same(ref_from_host, ref)
    assert resumed_opt.param_groups[0]["fused"] is fused_cpu_adamw_available(), "its own kernel after loading"


def test_defaults_rebuild_and_refusals():
    opt = HostAdamW([nn.Parameter(torch.zeros(3))], **HYPER)
    again = HostAdamW([nn.Parameter(torch.zeros(4))], **opt.defaults)
    assert again.defaults == opt.defaults
    with pytest.raises(ValueError, match="host tensors"):
        HostAdamW([nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="capturable"):
        HostAdamW([nn.Parameter(torch.zeros(3))], capturable=True)
