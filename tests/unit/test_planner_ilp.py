"""The operator-level planner (ILP) in one process: the plans it finds for a traced MLP, attention
block and stacked block against Megatron's, its costs against hand formulas, controls that the
cost model decides (data parallelism for many tokens and tiny weights, replication for a tiny
model, sharding under a memory limit), the conversion table, reshapes of split dimensions, and
clear errors for models it cannot shard."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.planner.ilp import CostModel, conversion, plan_operators
from tessera.planner.ilp_ops import PARTIAL, REPLICATED, Need, Shard, UnsupportedOperatorError, reshape_dim
from tessera.planner.spec import Cluster, Link

E = 4  # fp32 bytes


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Separate q, k, v projections, heads by view/transpose, causal SDPA, output projection."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.h, self.heads = h, heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.h // self.heads).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, -1).transpose(1, 2)  # -1: the local head size stays right
        v = self.v(x)  # a size read off a split tensor is the whole tensor's
        v = v.view(b, t, self.heads, v.size(-1) // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(x.shape))  # the whole shape, made local when split


class Stack(nn.Module):
    """Attention and MLP with pre-norms and residuals, and the loss inside the graph."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(h), Attention(h, heads), nn.LayerNorm(h), MLP(h)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return F.mse_loss(x, y)


class LossMLP(nn.Module):
    """An MLP on [tokens, h] with its loss inside the graph (the output is a number)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.mlp = MLP(h)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.mlp(x), y)


MEGATRON_MLP = {"fc1": "column", "act": "S(2)", "fc2": "row"}
MEGATRON_ATTENTION = {"q": "column", "k": "column", "v": "column", "scaled_dot_product_attention": "split(1)"}
MEGATRON_ATTENTION |= {"o": "row"}
DATA_PARALLEL = {"mlp_fc1": "split(0)", "mlp_act": "S(0)", "mlp_fc2": "split(0)", "mse_loss": "S(0)"}


def meta_plan(kind: str, n: int, h: int = 2048, heads: int = 16, tokens: tuple[int, ...] = (4, 1024), **kw):
    """A plan made at a size worth sharding, on the meta device (no memory, no compute)."""
    with torch.device("meta"):
        if kind == "mlp":
            model: nn.Module = MLP(h)
        elif kind == "attention":
            model = Attention(h, heads)
        elif kind == "stack":
            model = Stack(h, heads)
        else:
            model = LossMLP(h)
        shape = (*tokens, h)
        x = torch.randn(shape, requires_grad=kind in ("mlp", "attention"))
        inputs = (x,) if kind in ("mlp", "attention") else (x, torch.randn(shape))
    return plan_operators(model, inputs, n, kw.pop("costs", None), **kw)


def strategies(plan, names) -> dict[str, str]:
    return {name: plan.strategy(name) for name in names}


def ring(n: int) -> float:
    return (n - 1) / n


@pytest.mark.parametrize("n", [2, 4])
def test_mlp_is_megatrons_column_then_row(n):
    plan = meta_plan("mlp", n)
    assert strategies(plan, MEGATRON_MLP) == MEGATRON_MLP
    assert plan.layout("fc2") == PARTIAL
    tokens_bytes = 4 * 1024 * 2048 * E
    # one all-reduce forward (fc2's partial sums) and one backward (x's gradient, Megatron's f)
    assert [(c.phase, c.op) for c in plan.collectives] == [("backward", "all_reduce"), ("forward", "all_reduce")]
    assert plan.comm_bytes("all_reduce", "forward") == pytest.approx(2 * ring(n) * tokens_bytes)
    assert plan.comm_bytes("all_reduce", "backward") == pytest.approx(2 * ring(n) * tokens_bytes)
    assert [r.consumers for r in plan.reshards] == [("fc1",), ("output",)]


@pytest.mark.parametrize("n", [2, 4])
def test_attention_is_megatrons_heads_split(n):
    plan = meta_plan("attention", n)
    assert strategies(plan, MEGATRON_ATTENTION) == MEGATRON_ATTENTION
    # heads: [b, s, h] split on h is [b, s, heads, d] split on heads, then [b, heads, s, d] on dim 1
    assert [plan.layout(v) for v in ("view", "view_1", "transpose")] == [Shard(2), Shard(2), Shard(1)]
    assert plan.layout("reshape") == Shard(2)
    # q, k and v share one conversion of x: its gradient is all-reduced once
    assert plan.calls("all_reduce", "backward") == 1 and plan.calls("all_reduce", "forward") == 1
    assert plan.calls() == 2
    (entry,) = [r for r in plan.reshards if r.producer == "x"]
    assert entry.consumers == ("q", "k", "v") and entry.need == Need(REPLICATED, partial_grad=True)


def test_stacked_block_shards_both_halves_and_keeps_norms_whole():
    plan = meta_plan("stack", 2, h=4096, heads=32, tokens=(2, 1024))
    assert strategies(plan, ["attn_q", "attn_k", "attn_v", "attn_o", "mlp_fc1", "mlp_fc2"]) == {
        "attn_q": "column", "attn_k": "column", "attn_v": "column", "attn_o": "row",
        "mlp_fc1": "column", "mlp_fc2": "row",
    }  # fmt: skip
    assert plan.strategy("ln1") == plan.strategy("ln2") == "replicate"
    assert plan.calls("all_reduce", "forward") == 2 and plan.calls("all_reduce", "backward") == 2
    assert plan.calls() == 4


class SwiGLU(nn.Module):
    """LLaMA's MLP: silu(gate(x)) * up(x) -> down; ``fused``: gate and up as one Linear, chunked."""

    def __init__(self, h: int, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up = nn.Linear(h, 8 * h, bias=False)
        else:
            self.gate, self.up = nn.Linear(h, 4 * h, bias=False), nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.silu(gate) * up)


def test_swiglu_splits_gate_and_up_by_columns():
    with torch.device("meta"):
        model, x = SwiGLU(4096), torch.randn(2, 1024, 4096)
    plan = plan_operators(model, x, 4)
    assert strategies(plan, ["gate", "up", "silu", "mul", "down"]) == {
        "gate": "column", "up": "column", "silu": "S(2)", "mul": "S(2)", "down": "row",
    }  # fmt: skip
    assert plan.calls() == 1  # x needs no gradient: only the forward all-reduce


def test_chunk_is_never_split_along_its_own_dimension():
    # a column split of the fused Linear would hand each rank a block across both halves
    with torch.device("meta"):
        model, x = SwiGLU(4096, fused=True), torch.randn(2, 1024, 4096)
    plan = plan_operators(model, x, 4)
    assert plan.layout("chunk") != Shard(2)
    assert plan.layout("getitem") == plan.layout("getitem_1") == plan.layout("chunk")
    assert plan.strategy("down") == "row"  # it still splits the down projection's input


def test_costs_against_hand_formulas():
    n, h, tokens = 2, 2048, 4 * 1024
    costs = CostModel(flops=1e14, bandwidth=1e11, latency=5e-6, memory_s_per_byte=1e-13)
    plan = meta_plan("mlp", n, costs=costs)
    assert strategies(plan, MEGATRON_MLP) == MEGATRON_MLP
    flops = 6 * tokens * (h * 4 * h + 4 * h * h) / n  # forward + backward of both matmuls, split
    assert plan.compute_s == pytest.approx(flops / 1e14)
    all_reduce_s = 5e-6 + 2 * ring(n) * tokens * h * E / 1e11
    assert plan.comm_s == pytest.approx(2 * all_reduce_s)
    params = (4 * h * h + 4 * h) * E / n + 4 * h * h * E / n + h * E  # the row Linear's bias is whole
    assert plan.param_bytes == pytest.approx(params)
    expected = flops / 1e14 + 2 * all_reduce_s + 1e-13 * 4 * params + 2 * costs.reshard_overhead
    assert plan.cost == pytest.approx(expected)
    assert plan.choices["fc1"].compute_s == pytest.approx(6 * tokens * h * 4 * h / n / 1e14)


def test_many_tokens_and_tiny_weights_give_data_parallelism():
    # a million tokens of width 64: all-reducing activations costs far more than the weights
    plan = meta_plan("loss", 2, h=64, tokens=(1 << 20,))
    assert strategies(plan, DATA_PARALLEL) == DATA_PARALLEL
    assert plan.layout("mse_loss") == PARTIAL
    grads = 64 * 256 * E, 256 * E, 256 * 64 * E, 64 * E
    backward = sorted(c.payload_bytes for c in plan.collectives if c.phase == "backward")
    assert backward == sorted(grads)  # each parameter's gradient, all-reduced
    (forward,) = [c for c in plan.collectives if c.phase == "forward"]
    assert (forward.op, forward.payload_bytes) == ("all_reduce", E)  # the loss's partial sums
    # the same model with a few tokens and wide weights goes back to Megatron
    wide = meta_plan("loss", 2, h=4096, tokens=(512,))
    assert strategies(wide, ["mlp_fc1", "mlp_fc2"]) == {"mlp_fc1": "column", "mlp_fc2": "row"}


def test_tiny_model_stays_whole_unless_memory_forbids():
    h = 64
    with torch.device("meta"):
        model, x = MLP(h), torch.randn(2, 8, h, requires_grad=True)
    plan = plan_operators(model, x, 2)
    assert strategies(plan, MEGATRON_MLP) == {"fc1": "replicate", "act": "R", "fc2": "replicate"}
    assert plan.calls() == 0 and plan.comm_s == 0
    whole = 4.0 * sum(p.numel() * E for p in model.parameters())
    capped = plan_operators(model, x, 2, memory_limit=0.6 * whole)
    assert strategies(capped, MEGATRON_MLP) == MEGATRON_MLP
    assert capped.param_bytes * 4 <= 0.6 * whole
    with pytest.raises(UnsupportedOperatorError, match="no sharding over 2 ranks fits within memory_limit"):
        plan_operators(model, x, 2, memory_limit=0.1 * whole)


def test_cost_model_from_cluster():
    intra, inter, tensor = Link(3e11, 2e-6), Link(2.5e10, 1e-5), Link(1e11, 4e-6)
    cluster = Cluster(devices=16, device_memory=80 << 30, flops=3e14, intra=intra, inter=inter)
    assert CostModel.from_cluster(cluster, 8) == CostModel(flops=3e14, bandwidth=3e11, latency=2e-6)
    assert CostModel.from_cluster(cluster, 16).bandwidth == 2.5e10
    calibrated = Cluster(16, 80 << 30, 3e14, intra, inter, axis_links={"tensor": tensor})
    assert CostModel.from_cluster(calibrated, 8, latency=0.0) == CostModel(flops=3e14, bandwidth=1e11, latency=0.0)


def test_conversion_table():
    t, n = 1200, 4  # bytes of the tensor, ranks
    R, Rp, P = Need(REPLICATED), Need(REPLICATED, True), Need(PARTIAL)
    table = {
        (REPLICATED, R): [],
        (REPLICATED, Rp): [("backward", "all_reduce", t)],
        (REPLICATED, Need(Shard(1))): [("backward", "all_gather", t)],
        (REPLICATED, P): [],
        (Shard(1), R): [("forward", "all_gather", t)],
        (Shard(1), Rp): [("forward", "all_gather", t), ("backward", "reduce_scatter", t)],
        (Shard(1), Need(Shard(0))): [("forward", "all_to_all", t // n), ("backward", "all_to_all", t // n)],
        (Shard(1), P): None,
        (PARTIAL, R): [("forward", "all_reduce", t)],
        (PARTIAL, Rp): [("forward", "all_reduce", t), ("backward", "all_reduce", t)],
        (PARTIAL, Need(Shard(0))): [("forward", "reduce_scatter", t), ("backward", "all_gather", t)],
        (PARTIAL, P): [],
    }
    for (source, need), want in table.items():
        assert conversion(source, need, t, n, needs_grad=True) == want, (source, need)
    # without a gradient nothing flows backward
    assert conversion(PARTIAL, Need(Shard(0)), t, n, needs_grad=False) == [("forward", "reduce_scatter", t)]


def test_reshape_maps_split_dimensions():
    assert reshape_dim((2, 8, 64), (2, 8, 4, 16), 2, 2) == 2  # heads out of the hidden size
    assert reshape_dim((2, 8, 4, 16), (2, 8, 64), 2, 4) == 2  # and back
    assert reshape_dim((2, 8, 4, 16), (2, 8, 64), 3, 2) is None  # a split head size interleaves
    assert reshape_dim((2, 8, 6, 16), (2, 8, 96), 2, 4) is None  # 6 heads do not split 4 ways
    assert reshape_dim((2, 8, 64), (2, 8, 2, 32), 2, 4) is None  # 2 heads for 4 ranks
    assert reshape_dim((2, 8, 64), (16, 64), 0, 2) == 0  # flattened batch and sequence
    assert reshape_dim((2, 8, 64), (16, 64), 1, 2) is None
    assert reshape_dim((1, 8, 64), (8, 64), 1, 2) == 0  # size-1 dimensions aside


def test_describe_lists_choices_and_collectives():
    text = meta_plan("mlp", 2).describe()
    assert "operator-level plan over 2 ranks" in text
    assert "fc1   Linear    column    S(2)" in text and "fc2   Linear    row       P" in text
    assert "backward all_reduce" in text and "x R -> R* for fc1" in text
    assert "fc2 P -> R for output" in text


class Cumsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.fc(x), dim=1)


class Slicing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] * 2


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x))


def test_clear_errors_name_the_node():
    x = torch.randn(2, 4, 8)
    with pytest.raises(UnsupportedOperatorError, match=r"node 'cumsum' runs cumsum, which .* has no strategies"):
        plan_operators(Cumsum(), x, 2)
    with pytest.raises(UnsupportedOperatorError, match="node 'getitem' indexes a tensor"):
        plan_operators(Slicing(), x, 2)
    with pytest.raises(UnsupportedOperatorError, match="cannot trace Branchy with torch.fx.symbolic_trace"):
        plan_operators(Branchy(), x, 2)
    with pytest.raises(UnsupportedOperatorError, match="module 'fc' is called by nodes 'fc' and 'fc_1'"):
        plan_operators(Twice(), x, 2)


def test_missing_scipy_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with torch.device("meta"):
        model, x = MLP(8), torch.randn(2, 8)
    with pytest.raises(ImportError, match="pip install scipy"):
        plan_operators(model, x, 2)
