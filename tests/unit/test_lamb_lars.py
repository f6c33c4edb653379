"""LAMB and LARS against per-parameter references written from the papers' formulas."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tessera.context import set_context
from tessera.context.placement import Placement, ShardSpec, ZeroSlot, set_placement
from tessera.optim import LAMB, LARS, whole_sq_norms
from tessera.optim.lamb import default_exclude
from tessera.testing import tolerance, use_layout

STEPS = 20


@pytest.fixture(autouse=True)
def no_context_left_behind():
    """Tests here that make a one-rank context current clear it after them."""
    yield
    set_context(None)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(STEPS)]


def train(model: nn.Module, step) -> list[float]:
    """Run STEPS steps; ``step(params)`` updates the parameters from their gradients."""
    losses = []
    for x, y in batches():
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            step(list(model.parameters()))
        losses.append(loss.item())
    return losses


def ratio_or_one(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if num > 0 and den > 0 else 1.0


class ReferenceLAMB:
    """You et al. 2019, Algorithm 2, one parameter at a time."""

    def __init__(self, lr, betas, eps, weight_decay, excluded):
        self.lr, (self.b1, self.b2), self.eps, self.wd, self.excluded = lr, betas, eps, weight_decay, excluded
        self.state: dict[int, dict] = {}

    def __call__(self, params):
        for p in params:
            g = p.grad
            st = self.state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            st["t"] += 1
            t = st["t"]
            st["m"] = self.b1 * st["m"] + (1 - self.b1) * g
            st["v"] = self.b2 * st["v"] + (1 - self.b2) * g * g
            m_hat = st["m"] / (1 - self.b1**t)
            v_hat = st["v"] / (1 - self.b2**t)
            u = m_hat / (v_hat.sqrt() + self.eps) + self.wd * p
            r = 1.0 if self.excluded(p) else ratio_or_one(p.norm(), u.norm())
            p -= self.lr * r * u


class ReferenceLARS:
    """You et al. 2017 with momentum on the locally scaled gradient, one parameter at a time."""

    def __init__(self, lr, momentum, weight_decay, trust_coefficient, eps, excluded):
        self.lr, self.mu, self.wd, self.tc, self.eps = lr, momentum, weight_decay, trust_coefficient, eps
        self.excluded = excluded
        self.buf: dict[int, torch.Tensor] = {}

    def __call__(self, params):
        for p in params:
            g = p.grad
            if self.excluded(p):
                d = g
            else:
                wn, gn = p.norm(), g.norm()
                local = self.tc * wn / (gn + self.wd * wn + self.eps) if wn > 0 and gn > 0 else 1.0
                d = (g + self.wd * p) * local
            buf = self.buf.get(id(p), torch.zeros_like(p))
            self.buf[id(p)] = buf = self.mu * buf + d
            p -= self.lr * buf


def assert_same_training(make_opt, reference):
    model, ref_model = mlp(), mlp()
    opt = make_opt(model.parameters())
    losses = train(model, lambda params: opt.step())
    ref_losses = train(ref_model, reference)
    tol = tolerance(steps=STEPS)  # mlp(): about one block's depth; the steps' arithmetic in another order
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=name)
    assert not torch.equal(next(model.parameters()), next(mlp().parameters())), "the weights moved"
    return model


def is_vector(p):
    return p.ndim <= 1


def test_lamb_matches_the_per_parameter_reference():
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    assert_same_training(lambda ps: LAMB(ps, **kw), ReferenceLAMB(**kw, excluded=is_vector))


def test_lars_matches_the_per_parameter_reference():
    kw = dict(lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8)
    assert_same_training(lambda ps: LARS(ps, **kw), ReferenceLARS(**kw, excluded=is_vector))


def test_param_groups_keep_their_own_hyperparameters():
    def groups(params):
        params = list(params)
        return [{"params": params[:2], "lr": 3e-3}, {"params": params[2:], "weight_decay": 0.1}]

    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    first, rest = ReferenceLAMB(**{**kw, "lr": 3e-3}, excluded=is_vector), ReferenceLAMB(**{**kw, "weight_decay": 0.1}, excluded=is_vector)  # fmt: skip
    assert_same_training(lambda ps: LAMB(groups(ps), **kw), lambda ps: (first(ps[:2]), rest(ps[2:])))


def test_exclusion_rule_and_override():
    weight = torch.zeros(4, 4)
    piece_of_matrix = torch.zeros(3)
    set_placement(piece_of_matrix, Placement(zero=ZeroSlot(0, 1, (4, 4))))
    assert default_exclude(torch.zeros(4)) and default_exclude(torch.zeros(())) and not default_exclude(weight)
    assert not default_exclude(piece_of_matrix), "a 1-D piece of a matrix is adapted"
    # Excluding everything turns LAMB into AdamW and LARS into SGD with momentum (no weight decay).
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    assert_same_training(
        lambda ps: LAMB(ps, **kw, exclude=lambda p: True),
        torch_step(torch.optim.AdamW, **kw, foreach=False),
    )
    assert_same_training(
        lambda ps: LARS(ps, lr=0.05, momentum=0.9, weight_decay=0.05, exclude=lambda p: True),
        torch_step(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=False),
    )
    # Excluding nothing adapts the biases and the LayerNorm too.
    assert_same_training(
        lambda ps: LARS(ps, lr=0.5, trust_coefficient=0.02, weight_decay=1e-3, exclude=lambda p: False),
        ReferenceLARS(0.5, 0.9, 1e-3, 0.02, 1e-8, excluded=lambda p: False),
    )


def torch_step(cls, **kw):
    """A reference step by a torch optimizer built on the first call."""
    holder = {}

    def step(params):
        if "opt" not in holder:
            holder["opt"] = cls(params, **kw)
        holder["opt"].step()

    return step


def one_step(opt_cls, weight: torch.Tensor, grad: torch.Tensor, **kw) -> torch.Tensor:
    p = nn.Parameter(weight.clone())
    p.grad = grad.clone()
    opt_cls([p], **kw).step()
    return p.detach()


def test_lamb_zero_norms_use_ratio_one():
    g = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    # w = 0: ||w|| = 0, ratio 1: the first Adam step is -lr * sign(g) (to eps).
    stepped = one_step(LAMB, torch.zeros(3, 5), g, lr=0.1, eps=1e-12)
    torch.testing.assert_close(stepped, -0.1 * g.sign())
    # g = 0 and no weight decay: u = 0, ratio 1, nothing moves and nothing is NaN.
    w = torch.randn(3, 5)
    assert torch.equal(one_step(LAMB, w, torch.zeros(3, 5), lr=0.1), w)
    # Both zero.
    assert torch.equal(one_step(LAMB, torch.zeros(3, 5), torch.zeros(3, 5), lr=0.1), torch.zeros(3, 5))
    # A nonzero case uses the ratio: ||w|| / ||u|| with u = sign(g) on the first step.
    w = torch.full((3, 5), 2.0)
    ratio = w.norm() / g.sign().norm()
    torch.testing.assert_close(one_step(LAMB, w, g, lr=0.1, eps=1e-12), w - 0.1 * ratio * g.sign())


def test_lars_zero_norms_use_rate_one():
    g = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    # w = 0: local rate 1, plain SGD step.
    torch.testing.assert_close(one_step(LARS, torch.zeros(3, 5), g, lr=0.1, weight_decay=0.1), -0.1 * g)
    # g = 0 with weight decay: local rate 1, d = wd * w.
    w = torch.randn(3, 5)
    torch.testing.assert_close(one_step(LARS, w, torch.zeros(3, 5), lr=0.1, weight_decay=0.5), w - 0.1 * 0.5 * w)
    # Nonzero: the trust coefficient scales it.
    w = torch.full((3, 5), 2.0)
    local = 0.01 * w.norm() / (g.norm() + 0.1 * w.norm() + 1e-8)
    torch.testing.assert_close(
        one_step(LARS, w, g, lr=0.1, weight_decay=0.1, trust_coefficient=0.01), w - 0.1 * local * (g + 0.1 * w)
    )


@pytest.mark.parametrize(
    "cls,kw,keys",
    [
        (LAMB, dict(lr=2e-3, weight_decay=0.1), {"lr", "betas", "eps", "weight_decay"}),
        (LARS, dict(lr=0.3, momentum=0.8), {"lr", "momentum", "weight_decay", "trust_coefficient", "eps"}),
    ],
)
def test_defaults_rebuild_an_equivalent_optimizer(cls, kw, keys):
    opt = cls(mlp().parameters(), **kw, exclude=lambda p: False)
    assert set(opt.defaults) == keys
    assert all(opt.defaults[k] == v for k, v in kw.items())
    model, other = mlp(), mlp()
    a = cls(model.parameters(), **kw)
    b = type(a)([{"params": list(other.parameters())}], **a.defaults)
    train(model, lambda ps: a.step())
    train(other, lambda ps: b.step())
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_invalid_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="lr"):
        LAMB(mlp().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(mlp().parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="momentum"):
        LARS(mlp().parameters(), lr=0.1, momentum=math.nan)


def test_whole_sq_norms_without_ranks_are_the_local_squared_norms():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 3, generator=g), torch.zeros(0), torch.randn(7, generator=g).bfloat16()]
    params = [torch.empty(4, 3), torch.empty(0), torch.empty(7)]
    set_placement(params[0], Placement(shard=ShardSpec((4, 3), (("tensor",), ()))))
    set_placement(params[2], Placement(zero=ZeroSlot(1, 2, (7,))))
    expected = torch.tensor([float(t.double().pow(2).sum()) for t in tensors])
    got = whole_sq_norms(tensors, params, None)
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got, expected)
    # A one-rank context: every group has one member, so nothing is summed.
    torch.testing.assert_close(whole_sq_norms(tensors, params, use_layout()), expected)
    with pytest.raises(ValueError, match="2 tensors for 3"):
        whole_sq_norms(tensors[:2], params, None)


def test_optimizers_step_under_a_one_rank_context():
    use_layout()
    model = copy.deepcopy(mlp())
    opt = LAMB(model.parameters(), lr=1e-2)
    ref = ReferenceLAMB(1e-2, (0.9, 0.999), 1e-6, 0.0, excluded=is_vector)
    ref_model = mlp()
    train(model, lambda ps: opt.step())
    train(ref_model, ref)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, **tolerance(steps=STEPS))
