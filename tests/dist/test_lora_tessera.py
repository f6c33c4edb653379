"""LoRA adapters on tessera's own GPT, built in its layout: 1D column- and row-parallel linears
(fused q/k/v) with and without sequence-parallel regions, the 2D, 2.5D and 3D grid linears, and
MoE experts spread over the expert axis (with 1D tensor parallelism inside them). 10 AdamW steps
under each layout equal the same model and adapters trained in one process (losses and adapter
weights, fp32 ``tessera.testing.tolerance``); the frozen base is bitwise unchanged, and no rank
holds a gradient, an optimizer state or a sharded piece for it. The comm ledger checks the bytes
of the 1D and the grid splits against their formulas (docs/lora.md)."""

from __future__ import annotations

import pytest
import torch

import tessera
import tessera.lora
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.context.placement import placement_of
from tessera.errors import ConfigError
from tessera.models import NextTokenLoss, gpt
from tessera.parallel.tensor.common import local_shard
from tessera.testing import tolerance, use_layout

STEPS = 10
TOL = tolerance(blocks=2, steps=STEPS)
BATCH, SEQ, VOCAB, HIDDEN, LAYERS = 8, 16, 64, 32, 2
RANK, ALPHA = 4, 8.0
TARGETS = {"dense": ("qkv", "out", "fc", "proj"), "moe": ("qkv", "out", "experts")}


def build(family: str) -> torch.nn.Module:
    """A tiny GPT (dense, or with MoE blocks of 4 SwiGLU experts) in the current layout."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, max_seq_len=SEQ, d_model=HIDDEN, n_layers=LAYERS, n_heads=4)
    if family == "moe":
        return gpt("tiny-moe", **sizes, d_ff=32, num_experts=4)
    return gpt("tiny", **sizes, d_ff=64)


def adapted(family: str, rank: int = RANK) -> torch.nn.Module:
    """``build(family)`` with adapters whose factors hold non-zero values (B too, so the first step
    moves everything), drawn in full by name and cut as each factor is split: the same model in
    every layout."""
    model = tessera.lora.apply(build(family), rank=rank, alpha=ALPHA, targets=TARGETS[family])
    g = torch.Generator().manual_seed(3)
    factors = sorted((n, p) for n, p in model.named_parameters() if ".lora_" in n)
    with torch.no_grad():
        for _, param in factors:
            placement = placement_of(param)
            full = torch.randn(placement.full_shape(param), generator=g) * 0.1
            if placement.shard is not None:
                assert placement.mesh is not None
                full = local_shard(full, placement.shard, placement.mesh)
            param.copy_(full)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


LAYOUTS = {
    # name: (ranks, family, use_layout's sizes, parallel config)
    "1d-tp2": (2, "dense", dict(tensor=2), {"tensor": {"size": 2, "mode": "1d"}}),
    "1d-tp2-sequence-parallel": (
        2, "dense", dict(tensor=2, sequence_parallel=True),
        {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}},
    ),
    "2d-tp4": (4, "dense", dict(tensor=4, mode="2d"), {"tensor": {"size": 4, "mode": "2d"}}),
    "2.5d-tp8": (8, "dense", dict(tensor=8, mode="2.5d", depth=2), {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}}),
    "3d-tp8": (8, "dense", dict(tensor=8, mode="3d"), {"tensor": {"size": 8, "mode": "3d"}}),
    "2.5d-tp8-keep": (
        8, "dense", dict(tensor=8, mode="2.5d", depth=2, keep_blocks=True),
        {"tensor": {"size": 8, "mode": "2.5d", "depth": 2, "keep_blocks": True}},
    ),
    # rank 16: the 32 x 32 "out" layers are narrower than (4 q - 2) r, their factors 3D linears
    "3d-tp8-rank16": (8, "dense", dict(tensor=8, mode="3d"), {"tensor": {"size": 8, "mode": "3d"}}),
    "ep2": (2, "moe", dict(data=2, expert=2), {"data": 2, "expert": 2}),
    "ep2-tp2": (4, "moe", dict(data=2, expert=2, tensor=2), {"data": 2, "expert": 2, "tensor": {"size": 2, "mode": "1d"}}),
}  # fmt: skip


def rank_of(name: str) -> int:
    return 16 if name.endswith("rank16") else RANK


def splits_of(name: str) -> dict[str, str]:
    """How each adapted linear's adapter follows its base under layout ``name``, by layer."""
    if name.startswith(("2d", "2.5d", "3d")):
        linear = {"2.5d-tp8-keep": set(TARGETS["dense"]), "3d-tp8-rank16": {"out"}}.get(name, set())
        return {layer: "grid-linear" if layer in linear else "grid" for layer in TARGETS["dense"]}
    column, row = ("column", "row") if "tp2" in name else ("none", "none")
    return {"qkv": column, "out": row} | ({} if name.startswith("ep") else {"fc": column, "proj": row})


def train(name: str | None, family: str, parts: int = 1, rank: int = RANK):
    """10 AdamW steps of rank-``rank`` adapters on this rank of layout ``name`` (None: one process
    accumulating ``parts`` micro-batches per step, the data ranks' shares: an MoE routes each
    micro-batch on its own). The losses, the full state after, what this rank holds for frozen
    weights and how each layer's adapter is split."""
    if name is None:
        ctx = use_layout(config={"gradient_accumulation": parts})
    else:
        _, _, sizes, parallel = LAYOUTS[name]
        ctx = use_layout(**sizes, config={"parallel": parallel})
    model = adapted(family, rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    splits = {name.rsplit(".", 1)[-1]: layer.split for name, layer in tessera.lora.adapters(model)}
    data = ctx.size("data")
    mine = slice(ctx.local_rank("data") * BATCH // data, (ctx.local_rank("data") + 1) * BATCH // data)
    losses = [float(engine.train_batch(iter(zip(x[mine].chunk(parts), y[mine].chunk(parts), strict=True)))) for x, y in batches()]
    frozen = {id(p): n for n, p in engine.model.named_parameters() if ".lora_" not in n}
    held = [f"state of {frozen[id(p)]}" for p in engine.optimizer.state if id(p) in frozen]
    held += [f"gradient of {n}" for n, p in engine.model.named_parameters() if id(p) in frozen and p.grad is not None]
    stepped = [p for g in engine.optimizer.param_groups for p in g["params"]] + getattr(engine.optimizer, "params", [])
    held += [f"{frozen[id(p)]} stepped" for p in stepped if id(p) in frozen]
    return losses, full_state_dict(engine.model), held, splits


def initial_state(family: str, rank: int) -> dict[str, torch.Tensor]:
    use_layout(config={})
    return {k: v.detach().clone() for k, v in adapted(family, rank).state_dict().items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_on_tesseras_gpt_trains_as_one_process(pools, name):
    ranks, family, sizes, _ = LAYOUTS[name]
    parts, rank = sizes.get("data", 1), rank_of(name)
    expected_losses, expected, _, _ = train(None, family, parts, rank)
    initial = initial_state(family, rank)
    for losses, state, held, splits in pools.run(ranks, train, name, family, 1, rank, timeout=600):
        assert splits == splits_of(name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(expected)
        factors = [k for k in expected if ".lora_" in k]
        assert len(factors) == LAYERS * (8 if family == "dense" else 10)
        for key in factors:
            assert not torch.equal(expected[key], initial[key]), f"{key} did not train"
            torch.testing.assert_close(state[key], expected[key], **TOL, msg=lambda m, key=key: key + m)
        base = [k for k in expected if ".lora_" not in k]
        assert all(torch.equal(state[k], initial[k]) for k in base), "the frozen base moved"
        assert held == [], "a frozen weight got a gradient, an optimizer state or a piece"


# ---- what the adapters move ----------------------------------------------------------------------


def tensor_bytes(rank: int) -> dict:
    """The tensor axis's traffic of one step of the dense GPT with rank-``rank`` adapters under
    1D tp2 with sequence-parallel regions."""
    use_layout(tensor=2, sequence_parallel=True, config={"parallel": LAYOUTS["1d-tp2-sequence-parallel"][3]})
    model = adapted("dense", rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    with comm.ledger() as ledger:
        engine.train_batch(iter([batches()[0]]))
    return {op: ledger.payload_bytes(op, "tensor") for op in ("all_reduce", "all_gather", "reduce_scatter")}


def test_adapters_on_1d_linears_move_only_their_factors_gradients(pools):
    """Per token the adapters move nothing: doubling the rank adds exactly the added factors'
    gradients, summed once per backward (column-parallel qkv and fc: A, r x hidden; row-parallel
    out and proj: B, hidden x r), to the all-reduces, and nothing to the all-gathers and
    reduce-scatters of the sequence-parallel regions."""
    small, large = (pools.run(2, tensor_bytes, rank, timeout=300)[0] for rank in (RANK, 2 * RANK))
    element, added = 4, RANK
    expected = LAYERS * (2 * added * HIDDEN + 2 * HIDDEN * added) * element
    assert large["all_reduce"] - small["all_reduce"] == expected, (large, small)
    assert large["all_gather"] == small["all_gather"] and large["reduce_scatter"] == small["reduce_scatter"]


def moe_bytes(rank: int) -> dict:
    """Every collective's payload bytes of one step of the MoE GPT with rank-``rank`` adapters
    under ep2 x tp2 (this data rank's half of a batch)."""
    _, _, sizes, parallel = LAYOUTS["ep2-tp2"]
    use_layout(**sizes, config={"parallel": parallel})
    model = adapted("moe", rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    x, y = batches()[0]
    with comm.ledger() as ledger:
        engine.train_batch(iter([(x[: BATCH // 2], y[: BATCH // 2])]))
    return {key: counts["payload_bytes"] for key, counts in ledger.summary().items()}


def test_expert_adapters_move_only_their_factors_gradients(pools):
    """Doubling the rank under ep2 x tp2 adds nothing to the experts' all-to-alls (the adapters
    run inside the experts' computation); on the tensor axis it adds the whole factors' gradients
    (dense qkv's A and out's B, and each local expert's A of w_in and w_gate and B of w_out:
    ``r x d_model``); on the data axis the dense factors' local pieces only: the experts' factors
    are reduced over the ranks holding the same experts (here none other), not over the data ranks."""
    small, large = (pools.run(4, moe_bytes, rank, timeout=300)[0] for rank in (RANK, 2 * RANK))
    element, added, local_experts, tensor = 4, RANK, 4 // 2, 2
    whole = 2 * added * HIDDEN + local_experts * 3 * added * HIDDEN
    dense_pieces = added * HIDDEN + 3 * HIDDEN // tensor * added + added * HIDDEN // tensor + HIDDEN * added
    grown = {key: large[key] - small.get(key, 0) for key in large if large[key] != small.get(key, 0)}
    assert grown == {
        ("all_reduce", "tensor"): LAYERS * whole * element,
        ("all_reduce", "data"): LAYERS * dense_pieces * element,
    }, grown


def grid_bytes(name: str, rank: int) -> dict:
    """Every axis's all-reduce bytes and every other collective's of one step of the dense GPT
    with rank-``rank`` adapters under grid layout ``name``."""
    _, _, sizes, parallel = LAYOUTS[name]
    use_layout(**sizes, config={"parallel": parallel})
    model = adapted("dense", rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    with comm.ledger() as ledger:
        engine.train_batch(iter([batches()[0]]))
    return {key: counts["payload_bytes"] for key, counts in ledger.summary().items()}


GRID_AXES = {  # hidden axes (A x summed over them), batch axes (the factors' gradients summed), q
    "2d-tp4": (("2d_row",), ("2d_col",), 2),
    "3d-tp8": (("3d_output", "3d_input"), ("3d_weight",), 2),
}


@pytest.mark.parametrize("name", list(GRID_AXES))
def test_adapters_on_grid_linears_move_the_formulas_bytes(pools, name):
    """Per adapted layer, doubling the rank by ``r`` adds: on each hidden axis the all-reduce of
    ``A_h x_h`` forward and of its gradient backward, ``2 r`` elements per token of this rank
    (its batch block); on the batch axes the factors' gradients once per backward,
    ``r (in + out) / H`` (``H`` hidden blocks); and nothing to any other collective."""
    hidden_axes, batch_axes, q = GRID_AXES[name]
    ranks = LAYOUTS[name][0]
    small, large = (pools.run(ranks, grid_bytes, name, rank, timeout=300)[0] for rank in (RANK, 2 * RANK))
    element, added, tokens = 4, RANK, BATCH // q * SEQ
    blocks = q ** len(hidden_axes)
    linears = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 64), (64, HIDDEN)]  # qkv, out, fc, proj
    expected = {("all_reduce", axis): LAYERS * len(linears) * 2 * tokens * added * element for axis in hidden_axes}
    for axis in batch_axes:
        expected[("all_reduce", axis)] = LAYERS * sum(added * (i + o) // blocks for i, o in linears) * element
    grown = {key: large[key] - small.get(key, 0) for key in large if large[key] != small.get(key, 0)}
    assert grown == expected, (grown, expected)


# ---- what is refused ------------------------------------------------------------------------------


def adapt_the_head(name: str) -> str:
    _, _, sizes, parallel = LAYOUTS[name]
    use_layout(**sizes, config={"parallel": parallel})
    try:
        tessera.lora.apply(build("dense"), targets=("lm_head",))
    except ConfigError as error:
        return str(error)
    return "accepted"


def quantize_a_split_base() -> str:
    from tessera.lora.quant import quantize

    use_layout(tensor=2, config={"parallel": LAYOUTS["1d-tp2"][3]})
    try:
        quantize(adapted("dense"), "int8")
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_what_adapters_do_not_follow_is_refused_naming_it(pools):
    for ranks, name, head in ((2, "1d-tp2", "VocabParallelClassifier1D"), (4, "2d-tp4", "VocabParallelClassifier2D")):
        for message in pools.run(ranks, adapt_the_head, name, timeout=120):
            assert f"do not follow lm_head ({head})" in message
    for message in pools.run(2, quantize_a_split_base, timeout=120):
        assert "quantized frozen base cannot be split by tensor parallelism" in message
