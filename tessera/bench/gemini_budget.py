"""``tessera bench gemini``, the budget run: a GPT whose fp32 parameters, gradients and Adam
states need more than 4x the host budget trains on one rank under Gemini with a disk tier,
within baseline RSS + host budget + 25% + one micro-batch's activations (see
:mod:`tessera.bench.gemini`)."""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row
from tessera.bench.zero_sides import Workload, batches_of

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20


@dataclass(frozen=True)
class BudgetRun:
    """The GPT of the budget run (``n_layers`` blocks of width ``d_model``) and the host budget."""

    d_model: int = 256
    n_layers: int = 33
    seq_len: int = 64
    micro_batch: int = 4
    host_budget: int = 96 * _MIB
    steps: int = 3
    device_budget: int | None = None  # default: a twelfth of the host budget (gathered chunks, buckets)

    def model(self) -> torch.nn.Module:
        from tessera.models import gpt

        torch.manual_seed(0)
        heads = 8 if self.d_model % 8 == 0 else 1
        return gpt("small", max_seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers, n_heads=heads)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return batches_of(Workload("small", self.seq_len, self.micro_batch), 0, self.steps)


def budget_body(run: BudgetRun) -> dict[str, Any]:
    """One rank: baseline RSS, then the deferred GPT under Gemini with a disk tier for
    ``run.steps`` steps; the peak RSS, the losses, the tracer's activations and the tiers."""
    import tessera
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap
    from tessera.models import NextTokenLoss
    from tessera.testing import use_layout

    # the runtime first: the same code paths once on a miniature GPT (imports, the process group,
    # deferred init's and autograd's one-time set-up), so that the baseline holds them
    with tempfile.TemporaryDirectory() as folder:
        use_layout(config={"gemini": {"placement": "static", "offload_dir": folder}})
        with tessera.deferred_init():
            tiny = dataclasses.replace(run, d_model=16, n_layers=1).model()
        warm, *_ = tessera.initialize(tiny, torch.optim.AdamW(tiny.parameters(), lr=1e-3), NextTokenLoss())
        for batch in run.batches():
            warm.train_batch(iter([batch]))
        warm.strategy.close()
        del warm, tiny
    gc.collect()
    trim_heap()
    reset_peak_rss()
    baseline = peak_rss_bytes()
    with tempfile.TemporaryDirectory() as folder:
        gemini = {
            "placement": "static",
            "params_offload": 1.0,
            "optimizer_offload": 1.0,
            "device_budget": run.device_budget or run.host_budget // 12,
            "host_budget": run.host_budget,
            "offload_dir": folder,
        }
        use_layout(config={"gemini": gemini})
        with tessera.deferred_init():
            model = run.model()
        params = sum(p.numel() for p in model.parameters())
        engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
        losses = [engine.train_batch(iter([b])) for b in run.batches()]
        peak = peak_rss_bytes()
        report = engine.strategy.report()
        engine.strategy.close()
    return {"baseline": baseline, "peak": peak, "losses": losses, "params": params, "report": report}


def reference_body(run: BudgetRun) -> dict[str, Any]:
    """The same steps in plain single-process PyTorch (a process with enough memory), and what
    one micro-batch's forward pass adds to its peak RSS there: the activations."""
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap
    from tessera.models import NextTokenLoss

    model = run.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, activations = [], 0
    for x, y in run.batches():
        optimizer.zero_grad()
        gc.collect()
        trim_heap()
        reset_peak_rss()
        before = peak_rss_bytes() or 0
        loss = NextTokenLoss()(model(x), y)
        activations = max(activations, (peak_rss_bytes() or 0) - before)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "activation_bytes": activations}


def budget_rows(run: BudgetRun, pools: PoolSet | None = None) -> tuple[list[Row], dict[str, Any]]:
    """The budget row, and what it is made of: each side in a fresh process, or in ``pools``'
    one-rank pool (:func:`~tessera.bench.pools.rank_pool`)."""
    outcome: dict[str, Any] = {}
    for name, body in (("gemini", budget_body), ("reference", reference_body)):
        with rank_pool(1, pools) as pool:  # a fresh process each: its own baseline and peak
            outcome[name] = pool.run(body, run, timeout=1800)[0]
    ours = outcome["gemini"]
    activations = outcome["reference"]["activation_bytes"]  # measured in plain PyTorch
    bound = ours["baseline"] + 1.25 * run.host_budget + activations
    state = 16 * ours["params"]
    name = f"budget gpt d{run.d_model} L{run.n_layers} state {state / run.host_budget:.1f}x host"
    rows = [Row(name, "peak_rss_bytes", float(ours["peak"]), "base+1.25 host+act", float(bound))]
    outcome["state_bytes"] = state
    outcome["bound"] = bound
    return rows, outcome


__all__ = ["BudgetRun", "budget_rows"]
