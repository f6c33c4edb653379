"""2D (SUMMA) tensor-parallel layers on a 2 x 2 grid, checked against plain torch layers.

The bodies take the layout, so ``test_tp2p5d.py`` runs the same checks on 2.5D grids. Each
compares the forward output and the input, weight and bias gradients with the single-process
layer (fp32), for an even shape and an uneven one (odd sizes on q = 2: padding in batch, hidden
and classes).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch
from torch import nn

from tessera import comm
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.nn import plain
from tessera.parallel.tensor.common import ShardSpec, local_shard, spec_of
from tessera.testing import tolerance, use_layout

LAYOUT_2D = dict(tensor=4, mode="2d")

# mode -> (module, class suffix, axes splitting the batch (outermost first), hidden axis, depth axis)
MODES: dict[str, tuple[str, str, tuple[str, ...], str, str | None]] = {
    "2d": ("tp2d", "2D", ("2d_col",), "2d_row", None),
    "2.5d": ("tp2p5d", "2p5D", ("2.5d_dep", "2.5d_col"), "2.5d_row", "2.5d_dep"),
}
# a layer (or a block's pieces) forward and backward, against the single-process one
RTOL = ATOL = tolerance(depth=2 * 8)["rtol"]

# (batch, seq, hidden, out): an even shape and an uneven one (odd sizes: every split pads)
SHAPES = [(4, 3, 8, 12), (5, 2, 15, 21)]


class Setup:
    """The layout in force on this rank and how to cut full reference tensors to its blocks."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.ctx = use_layout(**layout)
        name, self.suffix, self.batch_axes, self.hidden_axis, self.dep_axis = MODES[layout["mode"]]
        self.mod = importlib.import_module(f"tessera.parallel.tensor.{name}")
        self.q = self.mod.hidden_parts(self.ctx)
        self.parts = self.mod.batch_parts(self.ctx)

    def layer(self, name: str, *args: Any, **kwargs: Any) -> nn.Module:
        return getattr(self.mod, name + self.suffix)(*args, ctx=self.ctx, **kwargs)

    def local(self, full: torch.Tensor, groups: int = 1, split_last: bool = True) -> torch.Tensor:
        """This rank's block of a full activation-like tensor (batch first), zero-padded."""
        dims = (self.batch_axes, *([()] * (full.dim() - 2)), (self.hidden_axis,) if split_last else ())
        groups_ = (1,) * (full.dim() - 1) + (groups,)
        return local_shard(full.detach(), ShardSpec(tuple(full.shape), tuple(dims), groups_), self.ctx)

    def real_rows(self, batch: int) -> int:
        """How many of this rank's batch rows are real (not padding)."""
        per = math.ceil(batch / self.parts)
        index = 0
        for axis in self.batch_axes:
            index = index * self.ctx.size(axis) + self.ctx.local_rank(axis)
        return max(0, min(per, batch - index * per))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_param_grads(s: Setup, parallel: nn.Module, reference: nn.Module) -> None:
    ref_grads = {k: p.grad for k, p in reference.named_parameters(remove_duplicate=False)}
    for name, p in parallel.named_parameters(remove_duplicate=False):
        expected = ref_grads[name]
        assert expected is not None and p.grad is not None, name
        spec = spec_of(p)
        _close(p.grad, local_shard(expected, spec, s.ctx) if spec is not None else expected, f"grad {name}")


def _check_state(parallel: nn.Module, reference: nn.Module) -> None:
    full, ref = full_state_dict(parallel), reference.state_dict()
    assert full.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(full[key], ref[key], rtol=0, atol=0, msg=key)


def _run_activation_layer(s: Setup, parallel: nn.Module, reference: nn.Module, x_full: torch.Tensor, groups: int = 1):
    """Feed the full input through split_activation (and the reference), compare the output
    block on the real rows and every gradient after backward of ``(out * R).sum()``."""
    load_full_state_dict(parallel, reference.state_dict())
    x_ref = x_full.clone().requires_grad_()
    out_ref = reference(x_ref)
    upstream = _rand(*out_ref.shape, seed=7)
    (out_ref * upstream).sum().backward()

    x = x_full.clone().requires_grad_()
    x_local = s.mod.split_activation(x, s.ctx)
    x_local.retain_grad()
    out = parallel(x_local)
    rows = s.real_rows(x_full.shape[0])
    _close(out[:rows], s.local(out_ref, groups)[:rows], "output")
    (out * s.local(upstream, groups)).sum().backward()
    _close(x.grad, x_ref.grad, "input grad")
    padding = s.local(torch.ones_like(x_full)) == 0
    assert not x_local.grad[padding].any(), "padded input units must get no gradient"
    _check_param_grads(s, parallel, reference)
    _check_state(parallel, reference)


# ---- bodies (run on every rank) ---------------------------------------------------------------


def body_linear(layout, batch, seq, fin, fout, **options):
    """``options``: the layers' SUMMA ``form`` and ``keep_blocks`` (default: the layer's own)."""
    s = Setup(layout)
    torch.manual_seed(0)
    ref = nn.Linear(fin, fout)
    _run_activation_layer(s, s.layer("Linear", fin, fout, **options), ref, _rand(batch, seq, fin, seed=1))
    # no sequence dimension, no bias
    ref = nn.Linear(fin, fout, bias=False)
    _run_activation_layer(s, s.layer("Linear", fin, fout, bias=False, **options), ref, _rand(batch, fin, seed=2))
    # fused outputs (q, k, v): each part split on its own
    ref = nn.Linear(fin, 3 * fout)
    fused = s.layer("Linear", fin, 3 * fout, out_groups=3, **options)
    _run_activation_layer(s, fused, ref, _rand(batch, seq, fin, seed=3), groups=3)
    return True


def body_layer_norm(layout, batch, seq, hidden):
    s = Setup(layout)
    for bias in (True, False):
        ref = nn.LayerNorm(hidden, bias=bias)
        with torch.no_grad():
            ref.weight.copy_(1 + 0.1 * _rand(hidden, seed=4))
            if bias:
                ref.bias.copy_(_rand(hidden, seed=5))
        x = 3 + 2 * _rand(batch, seq, hidden, seed=6)
        _run_activation_layer(s, s.layer("LayerNorm", hidden, bias=bias), ref, x)
    return True


def body_split_gather(layout, batch, seq, hidden):
    s = Setup(layout)
    x = _rand(batch, seq, hidden, seed=8).requires_grad_()
    local = s.mod.split_activation(x, s.ctx)
    assert local.shape == (math.ceil(batch / s.parts), seq, math.ceil(hidden / s.q))
    _close(local, s.local(x), "split")
    back = s.mod.gather_activation(local, s.ctx, full_shape=x.shape)
    _close(back, x.detach(), "gather")
    upstream = _rand(batch, seq, hidden, seed=9)
    (back * upstream).sum().backward()  # every rank backpropagates its own copy
    _close(x.grad, upstream, "round-trip grad")
    return True


def _ids(batch, seq, vocab, seed):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def body_embeddings(layout, batch, seq, vocab, dim):
    s = Setup(layout)
    ids = _ids(batch, seq, vocab, seed=10)
    rows = s.real_rows(batch)
    for name in ("Embedding", "VocabParallelEmbedding"):
        torch.manual_seed(1)
        ref = nn.Embedding(vocab, dim)
        par = s.layer(name, vocab, dim)
        load_full_state_dict(par, ref.state_dict())
        out_ref = ref(ids)
        upstream = _rand(*out_ref.shape, seed=11)
        (out_ref * upstream).sum().backward()
        out = par(ids)
        assert out.shape[-1] == math.ceil(dim / s.q), (name, out.shape)
        _close(out[:rows], s.local(out_ref)[:rows], f"{name} output")
        (out * s.local(upstream)).sum().backward()
        _check_param_grads(s, par, ref)
        _check_state(par, ref)
    return True


class _TiedLM(nn.Module):
    """Embedding, layer norm and a head sharing the embedding's weight (reference or parallel)."""

    def __init__(self, emb: nn.Module, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.emb, self.norm, self.head = emb, norm, head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def body_classifiers(layout, batch, seq, hidden, classes, keep_blocks=None):
    """Classifier + CrossEntropyLoss and VocabParallelClassifier + VocabParallelCrossEntropyLoss
    against Linear + torch CE; the tied embedding/head pair against a tied reference.
    ``keep_blocks``: the vocabulary-parallel heads' (default: the layer's own)."""
    s = Setup(layout)
    keep = {} if keep_blocks is None else {"keep_blocks": keep_blocks}
    targets = _ids(batch, seq, classes, seed=12)
    targets[0, 0] = -100  # an ignored target
    ce = nn.CrossEntropyLoss()
    for name, loss_name in (
        ("Classifier", "CrossEntropyLoss"),
        ("VocabParallelClassifier", "VocabParallelCrossEntropyLoss"),
    ):
        for bias in (True, False):
            torch.manual_seed(2)
            ref = nn.Linear(hidden, classes, bias=bias)
            par = s.layer(name, hidden, classes, bias=bias, **(keep if name != "Classifier" else {}))
            load_full_state_dict(par, ref.state_dict())
            x_full = _rand(batch, seq, hidden, seed=13)
            x_ref = x_full.clone().requires_grad_()
            loss_ref = ce(ref(x_ref).flatten(0, 1), targets.flatten())
            loss_ref.backward()
            x = x_full.clone().requires_grad_()
            logits = par(s.mod.split_activation(x, s.ctx))
            rows = s.real_rows(batch)
            ref_logits = ref(x_full).detach()
            if name == "Classifier":  # every class on every rank
                _close(logits[:rows], s.local(ref_logits, split_last=False)[:rows], "classifier logits")
            else:
                assert logits.shape[-1] == math.ceil(classes / s.q)
                gathered = s.mod.gather_activation(logits, s.ctx, full_shape=ref_logits.shape)
                _close(gathered, ref_logits, "vocab-parallel logits")
            loss = s.layer(loss_name)(logits, targets)
            _close(loss, loss_ref.detach(), f"{loss_name} value")
            loss.backward()
            _close(x.grad, x_ref.grad, f"{name} input grad")
            _check_param_grads(s, par, ref)

    # tied head: the shared weight's gradient sums the embedding's and the head's parts
    vocab = classes
    torch.manual_seed(3)
    ref_lm = _TiedLM(nn.Embedding(vocab, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False))
    ref_lm.head.weight = ref_lm.emb.weight
    emb = s.layer("VocabParallelEmbedding", vocab, hidden)
    head = s.layer("VocabParallelClassifier", hidden, vocab, weight=emb.weight, **keep)
    par_lm = _TiedLM(emb, s.layer("LayerNorm", hidden), head)
    assert par_lm.head.weight is par_lm.emb.weight
    load_full_state_dict(par_lm, ref_lm.state_dict())
    ce(ref_lm(targets.clamp(min=0)).flatten(0, 1), targets.flatten()).backward()
    loss = s.layer("VocabParallelCrossEntropyLoss")(par_lm(targets.clamp(min=0)), targets)
    loss.backward()
    _check_param_grads(s, par_lm, ref_lm)
    _check_state(par_lm, ref_lm)
    with pytest.raises(ValueError, match="tied weight"):
        s.layer("VocabParallelClassifier", hidden, vocab, weight=s.layer("Embedding", vocab, hidden).weight)
    return True


def body_cross_entropy_2d_logits(layout, batch, classes):
    """The losses on ``[b, C]`` logits (no sequence), fed directly."""
    s = Setup(layout)
    full = _rand(batch, classes, seed=14)
    targets = _ids(batch, 1, classes, seed=15).flatten()
    ref = full.clone().requires_grad_()
    loss_ref = nn.functional.cross_entropy(ref, targets)
    loss_ref.backward()
    rows = s.real_rows(batch)
    for loss_name, split_last in (("CrossEntropyLoss", False), ("VocabParallelCrossEntropyLoss", True)):
        local = s.local(full, split_last=split_last).requires_grad_()
        kwargs = {"num_classes": classes} if split_last else {}
        loss = s.layer(loss_name, **kwargs)(local, targets)
        _close(loss, loss_ref.detach(), f"{loss_name} value")
        loss.backward()
        _close(local.grad[:rows], s.local(ref.grad, split_last=split_last)[:rows], f"{loss_name} grad")
    return True


def body_patch_embedding(layout, batch, embed):
    s = Setup(layout)
    torch.manual_seed(4)
    ref = plain.PatchEmbedding(8, 4, 3, embed)
    with torch.no_grad():
        ref.cls_token.copy_(_rand(1, 1, embed, seed=16))
    par = s.layer("PatchEmbedding", 8, 4, 3, embed)
    load_full_state_dict(par, ref.state_dict())
    images = _rand(batch, 3, 8, 8, seed=17)
    out_ref = ref(images)
    upstream = _rand(*out_ref.shape, seed=18)
    (out_ref * upstream).sum().backward()
    out = par(images)
    rows = s.real_rows(batch)
    _close(out[:rows], s.local(out_ref)[:rows], "patch embedding output")
    (out * s.local(upstream)).sum().backward()
    _check_param_grads(s, par, ref)
    _check_state(par, ref)
    return True


def body_dropout(layout):
    s = Setup(layout)
    x = torch.ones(4, 3, 6)
    assert s.layer("Dropout", 0.0)(x) is x
    drop = s.layer("Dropout", 0.5)
    out = drop(x)
    mask = out != 0
    assert 0 < mask.sum() < mask.numel()
    _close(out[mask], torch.full_like(x, 2.0)[mask], "kept values scaled by 1/(1-p)")
    drop.eval()
    assert drop(x) is x
    after = torch.rand(4)  # the default stream is untouched: it still agrees across the group
    return mask, after


def body_summa_products(layout):
    """The three SUMMA products on matrices blocked over the grid (rank (i, j) holds block
    (i, j)), forward and both gradients, with the received blocks sent again or kept."""
    from tessera.parallel.tensor import summa
    from tessera.parallel.tensor.tp2d import grid_2d

    s = Setup(layout)
    grid = grid_2d(s.ctx)
    spec = lambda t: ShardSpec(tuple(t.shape), ((grid.col.name,), (grid.row.name,)))  # noqa: E731
    block = lambda t: local_shard(t.detach(), spec(t), s.ctx)  # noqa: E731
    m, k, n = 6, 8, 10
    cases = {  # name: (product, A's shape, B's shape, reference)
        "ab": (summa.matmul_ab, (m, k), (k, n), lambda a, b: a @ b),
        "abt": (summa.matmul_abt, (m, k), (n, k), lambda a, b: a @ b.t()),
        "atb": (summa.matmul_atb, (k, m), (k, n), lambda a, b: a.t() @ b),
    }
    for seed, (name, (product, a_shape, b_shape, reference)) in enumerate(cases.items()):
        a, b = _rand(*a_shape, seed=30 + seed).requires_grad_(), _rand(*b_shape, seed=40 + seed).requires_grad_()
        c = reference(a, b)
        upstream = _rand(*c.shape, seed=50 + seed)
        (c * upstream).sum().backward()
        plain = {"ab": summa.summa_ab, "abt": summa.summa_abt, "atb": summa.summa_atb}[name]
        _close(plain(block(a), block(b), grid.row, grid.col), block(c), f"{name} without autograd")
        for keep in (False, True):
            a_blk, b_blk = block(a).requires_grad_(), block(b).requires_grad_()
            c_blk = product(a_blk, b_blk, grid.row, grid.col, keep=keep)
            _close(c_blk, block(c), f"{name} keep={keep}")
            (c_blk * block(upstream)).sum().backward()
            _close(a_blk.grad, block(a.grad), f"{name} keep={keep} dA")
            _close(b_blk.grad, block(b.grad), f"{name} keep={keep} dB")
    return True


def test_summa_products_and_their_gradients_match_torch(pools):
    assert pools.run(4, body_summa_products, LAYOUT_2D) == [True] * 4


def body_linear_ledger(layout, batch, seq, fin, fout):
    """Logical bytes of one Linear forward + backward per (op, axis), against the formula."""
    s = Setup(layout)
    q, d = s.q, s.parts // s.q
    layer = s.layer("Linear", fin, fout)
    x = _rand(math.ceil(batch / s.parts), seq, math.ceil(fin / q), seed=19).requires_grad_()  # a local block
    with comm.ledger() as led:
        y = layer(x)
        (y * _rand(*y.shape, seed=20)).sum().backward()
    f32 = 4
    x_blk = x.numel() * f32  # [b/(dq) * s, in/q]
    w_blk = math.ceil(fin / q) * math.ceil(fout / q) * f32  # [out/q, in/q]
    b_blk = math.ceil(fout / q) * f32
    col = s.batch_axes[-1]
    expected = {
        ("broadcast", s.hidden_axis): 2 * (q - 1) * x_blk,  # X_il, forward and for dW
        ("reduce", s.hidden_axis): (q - 1) * x_blk,  # dX shares
        ("broadcast", col): 2 * (q - 1) * w_blk,  # W_lj, forward and for dX
        ("reduce", col): (q - 1) * w_blk,  # dW shares
        ("all_reduce", col): 2 * (q - 1) / q * b_blk,  # bias gradient over the batch blocks
    }
    if s.dep_axis is not None:
        expected[("all_reduce", s.dep_axis)] = 2 * (d - 1) / d * (w_blk + b_blk)  # parameter grads over depth
    got = {key: v["bytes"] for key, v in led.summary().items()}
    assert got.keys() == {k for k, v in expected.items() if v}, got
    for key, value in got.items():
        assert math.isclose(value, expected[key]), (key, value, expected[key])
    total = 3 * (q - 1) * (x_blk + w_blk) + 2 * (q - 1) / q * b_blk + 2 * (d - 1) / d * (w_blk + b_blk)
    assert math.isclose(led.bytes(), total), (led.bytes(), total)
    # memory: 1/q^2 of the padded full weight, 1/q of the padded bias
    assert layer.weight.numel() * q * q == math.ceil(fout / q) * q * math.ceil(fin / q) * q
    assert layer.bias.numel() * q == math.ceil(fout / q) * q
    return led.bytes()


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_torch(pools, shape):
    assert pools.run(4, body_linear, LAYOUT_2D, *shape) == [True] * 4


# (batch, seq, in, out) with out < in: the layers' own choice is C = A B^T there
NARROWING = [(4, 3, 12, 8), (5, 2, 21, 15)]


@pytest.mark.parametrize("keep", [False, True], ids=["rebroadcast", "keep_blocks"])
@pytest.mark.parametrize("form", ["ab", "abt"])
@pytest.mark.parametrize("shape", SHAPES + NARROWING)
def test_linear_in_each_summa_form_matches_torch(pools, shape, form, keep):
    assert pools.run(4, body_linear, LAYOUT_2D, *shape, form=form, keep_blocks=keep) == [True] * 4


def body_summa_forms(layout):
    """The form each Linear takes by itself: the wider side stays put; the weight's blocks follow."""
    s = Setup(layout)
    row, col = s.hidden_axis, s.batch_axes[-1]
    for fin, fout, form in ((8, 12, "ab"), (12, 12, "ab"), (12, 8, "abt"), (15, 13, "abt")):
        layer = s.layer("Linear", fin, fout)
        dims = ((row,), (col,)) if form == "ab" else ((col,), (row,))
        assert (layer.form, spec_of(layer.weight).dims) == (form, dims), (fin, fout, layer.form)
    emb = s.layer("VocabParallelEmbedding", 8, 16)
    assert s.layer("VocabParallelClassifier", 16, 8).form == "abt"  # untied: the wider side stays
    assert s.layer("VocabParallelClassifier", 16, 8, weight=emb.weight).form == "ab"  # as the embedding
    with pytest.raises(ValueError, match="SUMMA form"):
        s.layer("Linear", 4, 4, form="atb")
    return True


def test_each_linear_keeps_its_wider_side_put(pools):
    assert pools.run(4, body_summa_forms, LAYOUT_2D) == [True] * 4


@pytest.mark.parametrize("keep", [False, True], ids=["rebroadcast", "keep_blocks"])
@pytest.mark.parametrize("shape", [(4, 3, 8, 16), (4, 3, 16, 8)])
def test_vocab_parallel_heads_in_each_form_match_torch(pools, shape, keep):
    # hidden 16 > 8 classes: the untied vocabulary-parallel head runs as C = A B^T, the tied one as A B
    assert pools.run(4, body_classifiers, LAYOUT_2D, *shape, keep_blocks=keep) == [True] * 4


@pytest.mark.parametrize("shape", [(4, 3, 8), (5, 2, 15)])
def test_layer_norm_matches_torch(pools, shape):
    assert pools.run(4, body_layer_norm, LAYOUT_2D, *shape) == [True] * 4


def test_split_gather_round_trip(pools):
    assert pools.run(4, body_split_gather, LAYOUT_2D, 5, 2, 15) == [True] * 4


@pytest.mark.parametrize("shape", [(4, 3, 16, 8), (5, 2, 51, 15)])
def test_embeddings_match_torch(pools, shape):
    assert pools.run(4, body_embeddings, LAYOUT_2D, *shape) == [True] * 4


@pytest.mark.parametrize("shape", [(4, 3, 8, 16), (5, 2, 15, 51)])
def test_classifiers_and_losses_match_torch(pools, shape):
    assert pools.run(4, body_classifiers, LAYOUT_2D, *shape) == [True] * 4


def test_losses_on_unsequenced_logits(pools):
    assert pools.run(4, body_cross_entropy_2d_logits, LAYOUT_2D, 5, 51) == [True] * 4


@pytest.mark.parametrize("embed", [12, 15])
def test_patch_embedding_matches_reference(pools, embed):
    assert pools.run(4, body_patch_embedding, LAYOUT_2D, 5, embed) == [True] * 4


def test_dropout_masks_differ_per_block_and_keep_the_default_stream(pools):
    results = pools.run(4, body_dropout, LAYOUT_2D)
    masks = [m for m, _ in results]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(masks[a], masks[b]), (a, b)
    assert all(torch.equal(after, results[0][1]) for _, after in results)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_ledger_matches_optimus_formula(pools, shape):
    # 3 (q-1) (|X| + |W|) + 2 (q-1)/q |bias| bytes per rank (see body_linear_ledger per op/axis)
    assert len(set(pools.run(4, body_linear_ledger, LAYOUT_2D, *shape))) == 1
