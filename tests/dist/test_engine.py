"""The engine under data parallelism reproduces plain single-process PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError, TesseraError
from tessera.testing import tolerance, use_layout

GLOBAL_BATCH = 16
STEPS = 20
LR = 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))  # fmt: skip


def make_dataset(n: int = GLOBAL_BATCH * STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 12, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return TensorDataset(x, y)


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":  # not scale-invariant like Adam, so clipping shows in the trajectory
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def reference_run(
    clip: float | None = None, steps: int = STEPS, optimizer: str = "adamw"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on one process: the answer every layout must give."""
    model = make_model()
    opt = make_optimizer(model, optimizer)
    x, y = make_dataset().tensors
    losses = []
    for step in range(steps):
        xb, yb = x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def body_train(config: dict, steps: int = STEPS, optimizer: str = "adamw"):
    """Train with tessera on every rank; the per-rank micro-batch keeps the global batch fixed."""
    ctx = use_layout(config=config)
    accumulation = tessera.current_config().gradient_accumulation
    micro = GLOBAL_BATCH // (ctx.size("data") * accumulation)
    model = make_model()
    opt = make_optimizer(model, optimizer)
    loader = DataLoader(make_dataset(), batch_size=micro, shuffle=False)
    engine, loader, _, _ = tessera.initialize(model, opt, nn.CrossEntropyLoss(), loader)
    data_iter = iter(loader)
    losses = [engine.train_batch(data_iter) for _ in range(steps)]
    state = full_state_dict(engine.model)
    return losses, (state if ctx.rank == 0 else None), (engine.scaler.scale if engine.scaler else None)


def assert_same_run(got, expected, steps: int = STEPS):
    """``steps`` steps of make_model() (about one block's depth) give the reference's run."""
    losses, state, _ = got
    ref_losses, ref_state = expected
    tol = tolerance(steps=steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **tol, msg=key)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_one_process_matches_plain_pytorch(reference, accumulation):
    assert_same_run(body_train({"gradient_accumulation": accumulation}), reference)


@pytest.mark.parametrize(("ranks", "accumulation"), [(2, 1), (2, 4), (4, 1), (4, 2)])
def test_data_parallel_matches_plain_pytorch(pools, reference, ranks, accumulation):
    results = pools.run(ranks, body_train, {"gradient_accumulation": accumulation})
    assert_same_run(results[0], reference)
    assert all(r[0] == results[0][0] for r in results), "every rank reports the same global loss"


def test_clipping_matches_torch_clip_grad_norm(pools):
    expected = reference_run(clip=0.05, optimizer="sgd")
    assert_same_run(body_train({"clip_grad_norm": 0.05}, optimizer="sgd"), expected)
    config = {"clip_grad_norm": 0.05, "gradient_accumulation": 2}
    assert_same_run(pools.run(2, body_train, config, optimizer="sgd")[0], expected)
    unclipped = reference_run(optimizer="sgd")
    assert not math.isclose(expected[0][-1], unclipped[0][-1], rel_tol=1e-2), "the clip must be active"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_tracks_fp32(pools, reference, dtype):
    # From 2^16 this model's first fp16 backward overflows; the skipped step then shifts the
    # whole trajectory by one step (that path is tested below), so start from a scale that fits.
    precision = {"dtype": dtype, "initial_scale": 2.0**10}
    losses, _, scale = pools.run(2, body_train, {"mixed_precision": precision})[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference[0])]
    assert max(rel) < 2e-2, rel
    if dtype == "fp16":
        assert scale == 2.0**10, "no step was skipped"


def body_overflow():
    """fp16 on 2 ranks: rank 1 alone sees an inf gradient at step 3."""
    ctx = use_layout(config={"mixed_precision": {"dtype": "fp16", "initial_scale": 1024.0, "growth_interval": 2}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH // 2)
    engine, loader, _, _ = tessera.initialize(model, opt, nn.CrossEntropyLoss(), loader)
    log = []
    for step, (x, y) in zip(range(6), loader):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        if step == 3 and ctx.rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")  # after the DDP reduction: rank 1 only
        before = [p.detach().clone() for p in model.parameters()]
        stepped = engine.step()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((stepped, engine.scaler.scale, unchanged))
    return log


def test_an_overflow_on_one_rank_skips_the_step_everywhere(pools):
    logs = pools.run(2, body_overflow)
    assert logs[0] == logs[1]
    stepped, scales, unchanged = zip(*logs[0])
    assert stepped == (True, True, True, False, True, True)
    assert unchanged == (False, False, False, True, False, False)
    # grows x2 after every 2 clean steps, halves on the overflow, grows again after 2 clean ones
    assert scales == (1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0)


def body_memory_report():
    ctx = use_layout(config={})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(make_dataset(), batch_size=4)
    engine, loader, _, _ = tessera.initialize(model, opt, nn.CrossEntropyLoss(), loader)
    trainer = tessera.Trainer(engine, hooks=[tessera.engine.MemoryHook()])
    trainer.fit(loader, steps=2)
    n_elements = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    step_bytes = torch.tensor(0.0).element_size()  # AdamW keeps a float32 step count per parameter
    expected = {"param_bytes": 4 * n_elements, "grad_bytes": 4 * n_elements,
                "optimizer_bytes": 2 * 4 * n_elements + n_tensors * step_bytes}  # fmt: skip
    got = {k: trainer.metrics[k] for k in expected}
    assert got == expected, (got, expected, ctx.rank)
    assert trainer.metrics["peak_rss_bytes"] > 50 * 2**20
    return True


def test_memory_report_is_the_exact_sum_of_model_state(pools):
    assert pools.run(2, body_memory_report) == [True, True]


def test_calling_a_missing_criterion_says_what_to_do():
    use_layout(config={})
    model = make_model()
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TesseraError, match="pass criterion=... .*to initialize"):
        engine.criterion(engine(torch.randn(2, 12)), torch.zeros(2, dtype=torch.long))


def body_small_loader():
    use_layout(config={})
    model = make_model()
    loader = DataLoader(make_dataset(3), batch_size=1)
    tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), loader)


def test_a_loader_with_fewer_samples_than_ranks_is_rejected(pools):
    with pytest.raises(Exception, match="the data loader has 3 samples, fewer than the 4 data-parallel ranks"):
        pools.run(4, body_small_loader)


def test_a_non_finite_fp32_loss_names_the_step():
    use_layout(config={})
    model = make_model()
    x, y = make_dataset(64).tensors
    x[40:48] = float("nan")  # the sixth batch of 8
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    engine, loader, _, _ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              nn.CrossEntropyLoss(), loader)  # fmt: skip
    data_iter = iter(loader)
    for _ in range(5):
        engine.train_batch(data_iter)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 5"):
        engine.train_batch(data_iter)


def test_config_errors_reach_initialize():
    use_layout(config={"gemini": {"enabled": True, "device_budget": 1}})
    model = make_model()
    with pytest.raises(tessera.BudgetError, match="gemini.device_budget"):
        tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="parallel.tensor.size=3"):
        use_layout(config={"parallel": {"tensor": {"size": 3, "mode": "2d"}}})


def body_ledger_per_step():
    ctx = use_layout(config={})
    model = make_model()
    loader = DataLoader(make_dataset(), batch_size=4)
    engine, loader, _, _ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              nn.CrossEntropyLoss(), loader)  # fmt: skip
    data_iter = iter(loader)
    engine.train_batch(data_iter)  # DDP's first step rebuilds its buckets
    with tessera.comm.ledger() as led:
        engine.train_batch(data_iter)
    p = ctx.size("data")
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    loss_bytes = 4  # the reported loss, averaged over the data axis
    return led.bytes("all_reduce", "data"), 2 * (p - 1) / p * (grad_bytes + loss_bytes), led.calls(axis="tensor")


def test_data_parallel_gradients_go_through_the_ledger(pools):
    for got, expected, other in pools.run(4, body_ledger_per_step):
        assert got == pytest.approx(expected, rel=1e-12) and other == 0
