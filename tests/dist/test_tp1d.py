"""1D (Megatron) tensor parallelism against single-process torch, on 2 and 4 ranks.

Every layer is built from the same seed as its plain reference (and must hold the same weights),
given the plain layer's (perturbed) weights, fed the full input and compared in output, input
gradient and every parameter gradient (the local block of the reference gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.nn import (
    Classifier1D,
    CrossEntropyLoss1D,
    Dropout1D,
    Embedding1D,
    LayerNorm1D,
    Linear1D_Col,
    Linear1D_Row,
    PatchEmbedding1D,
    VocabParallelClassifier1D,
    VocabParallelCrossEntropyLoss1D,
    VocabParallelEmbedding1D,
)
from tessera.parallel.tensor.common import ShardSpec, local_shard, round_up, spec_of
from tessera.parallel.tensor.plain import PatchEmbedding
from tessera.parallel.tensor.tp1d import gather_activation, hidden_parts, split_activation
from tessera.testing import tolerance, use_layout

TOL = tolerance(depth=2 * 8)  # a layer (or a block's pieces) forward and backward, against one process
WORLDS = [2, 4]  # use_layout(tensor=world) on the pool of that size
TP2_DP2 = dict(tensor=2)  # on the 4-rank pool: tensor 2 x data 2


def _uneven(size_on_4: int, parts: int) -> int:
    """A size that does not divide ``parts``: 30 / 50 on P=4, 15 / 25 on P=2."""
    size = size_on_4 if parts == 4 else size_on_4 // 2
    assert size % parts != 0
    return size


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _last_dim_block(t: torch.Tensor, ctx, groups: int = 1) -> torch.Tensor:
    """This rank's (zero-padded) block of ``t`` split on its last dimension over ``tensor``."""
    dims = ((),) * (t.dim() - 1) + (("tensor",),)
    return local_shard(t, ShardSpec(tuple(t.shape), dims, (1,) * (t.dim() - 1) + (groups,)), ctx)


def _real_entries(size: int, ctx) -> int:
    """How many of this rank's block of a ``size`` dimension split over ``tensor`` are real (not padding)."""
    parts, index = ctx.size("tensor"), ctx.local_rank("tensor")
    block = round_up(size, parts) // parts
    return max(0, min(block, size - index * block))


def _seq_part(t: torch.Tensor, ctx) -> torch.Tensor:
    return t.chunk(ctx.size("tensor"), dim=1)[ctx.local_rank("tensor")]


def _perturb(module: nn.Module, seed: int) -> None:
    """Move every parameter off its init (LayerNorm's ones and zeros test little)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def _check_params(parallel: nn.Module, plain: nn.Module, ctx) -> None:
    """Each parameter and its gradient is the local block of the plain one (padding zero), and
    the full state dict is the plain one."""
    reference = dict(plain.named_parameters())
    for name, param in parallel.named_parameters():
        want, want_grad = reference[name].detach(), reference[name].grad
        spec = spec_of(param)
        if spec is not None:
            want, want_grad = local_shard(want, spec, ctx), local_shard(want_grad, spec, ctx)
        torch.testing.assert_close(param.detach(), want, **TOL, msg=f"{name}: value")
        torch.testing.assert_close(param.grad, want_grad, **TOL, msg=f"{name}: gradient")
    _check_state_dict(parallel, plain)


def _check_state_dict(parallel: nn.Module, plain: nn.Module) -> None:
    full, want = full_state_dict(parallel), plain.state_dict()
    assert full.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(full[key], want[key], rtol=0, atol=0, msg=key)


def _compare(
    ctx,
    make_plain: Callable[[], nn.Module],
    make_parallel: Callable[[], nn.Module],
    inputs: torch.Tensor,
    *,
    local_in: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    local_out: Callable[[torch.Tensor], torch.Tensor] = lambda y: y,
    local_in_grad: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
    local_upstream: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """The reference test: ``local_in`` maps the full input to the parallel layer's input (in
    autograd), ``local_out`` the plain output (and upstream gradient) to the parallel output's
    layout, ``local_in_grad`` the full input gradient to what this rank's input gradient holds;
    ``local_upstream`` (default ``local_out``) maps the upstream gradient."""
    torch.manual_seed(7)
    plain = make_plain()
    torch.manual_seed(7)
    parallel = make_parallel()
    _check_state_dict(parallel, plain)  # same seed, same weights
    _perturb(plain, seed=8)
    load_full_state_dict(parallel, plain.state_dict())

    grad_in = inputs.is_floating_point()
    x_ref = inputs.clone().requires_grad_(grad_in)
    y_ref = plain(x_ref)
    upstream = _randn(*y_ref.shape, seed=9)
    (y_ref * upstream).sum().backward()

    x = inputs.clone().requires_grad_(grad_in)
    y = parallel(local_in(x))
    torch.testing.assert_close(y, local_out(y_ref.detach()), **TOL)
    (y * (local_upstream or local_out)(upstream)).sum().backward()
    if grad_in:
        assert x.grad is not None and x_ref.grad is not None
        torch.testing.assert_close(local_in_grad(x.grad), local_in_grad(x_ref.grad), **TOL)
    _check_params(parallel, plain, ctx)


# ---- linear layers -------------------------------------------------------------------------


def body_linear(layout):
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    col_out = lambda y: _last_dim_block(y, ctx)
    row_in = lambda x: _last_dim_block(x, ctx)

    def row_in_with_junk(x, fan_in):  # padded input columns hold junk (e.g. after a nonlinearity)
        block = _last_dim_block(x, ctx)
        real = _real_entries(fan_in, ctx)
        return torch.cat([block[..., :real], torch.full_like(block[..., real:], 7.0)], dim=-1)

    for fan_in, fan_out, bias in ((8, 16, True), (6, _uneven(30, P), True), (5, 7, False)):
        x = _randn(2, 3, fan_in, seed=fan_out)
        make_plain = partial(nn.Linear, fan_in, fan_out, bias=bias)
        _compare(ctx, make_plain, partial(Linear1D_Col, fan_in, fan_out, bias), x, local_out=col_out)
        _compare(ctx, make_plain, partial(Linear1D_Col, fan_in, fan_out, bias, gather_output=True), x)
    # the row layer's input is split; 5 on P=4 leaves the last rank no real column at all
    for fan_in, fan_out, bias in ((16, 8, True), (_uneven(30, P), 6, True), (5, 3, False)):
        x = _randn(2, 3, fan_in, seed=fan_in)
        make_plain = partial(nn.Linear, fan_in, fan_out, bias=bias)
        make_row = partial(Linear1D_Row, fan_in, fan_out, bias)
        _compare(ctx, make_plain, make_row, x, local_in=row_in, local_in_grad=row_in)
        junk_in = partial(row_in_with_junk, fan_in=fan_in)
        _compare(ctx, make_plain, make_row, x, local_in=junk_in, local_in_grad=row_in)
        _compare(ctx, make_plain, partial(Linear1D_Row, fan_in, fan_out, bias, input_is_parallel=False), x)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_linear_col_and_row_match_torch(pools, world):
    assert pools.run(world, body_linear, {"tensor": world}) == [True] * world


def body_fused_qkv(layout):
    """out_groups=3: the local output is this rank's block of q, then of k, then of v."""
    ctx = use_layout(**layout)
    P, t = ctx.size("tensor"), ctx.local_rank("tensor")
    for h in (8, 5):
        x = _randn(2, 3, h, seed=h)
        make_plain = partial(nn.Linear, h, 3 * h)
        make_col = partial(Linear1D_Col, h, 3 * h, out_groups=3)
        _compare(ctx, make_plain, make_col, x, local_out=lambda y: _last_dim_block(y, ctx, groups=3))
        _compare(ctx, make_plain, partial(Linear1D_Col, h, 3 * h, out_groups=3, gather_output=True), x)
        # the mapping spelled out: pad each of q, k, v to a multiple of P and take block t
        torch.manual_seed(0)
        plain, col = nn.Linear(h, 3 * h), Linear1D_Col(h, 3 * h, out_groups=3)
        load_full_state_dict(col, plain.state_dict())
        block = round_up(h, P) // P
        expected = []
        for part in plain(x).detach().split(h, dim=-1):
            padded = F.pad(part, (0, round_up(h, P) - h))
            expected.append(padded[..., t * block : (t + 1) * block])
        torch.testing.assert_close(col(x), torch.cat(expected, dim=-1), **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_fused_qkv_output_groups(pools, world):
    assert pools.run(world, body_fused_qkv, {"tensor": world}) == [True] * world


def _plain_mlp(h: int, f: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(h), nn.Linear(h, f), nn.GELU(), nn.Linear(f, h), nn.LayerNorm(h))


def _parallel_mlp(h: int, f: int, sp: bool) -> nn.Module:
    return nn.Sequential(
        LayerNorm1D(h, sequence_parallel=sp),
        Linear1D_Col(h, f, sequence_parallel=sp),
        nn.GELU(),
        Linear1D_Row(f, h, sequence_parallel=sp),
        LayerNorm1D(h, sequence_parallel=sp),
    )


def body_mlp(layout, sequence_parallel):
    """LayerNorm -> Col -> GELU -> Row -> LayerNorm, the Megatron MLP block, with and without
    sequence parallelism; the input enters through split_activation."""
    ctx = use_layout(**layout)
    P, sp = ctx.size("tensor"), sequence_parallel
    assert hidden_parts(ctx) == 1
    for h, f in ((8, 16), (6, _uneven(30, P))):
        x = _randn(2, 4, h, seed=f)
        _compare(
            ctx,
            partial(_plain_mlp, h, f),
            partial(_parallel_mlp, h, f, sp),
            x,
            local_in=lambda x: split_activation(x, ctx, sequence_parallel=sp),
            local_out=(lambda y: _seq_part(y, ctx)) if sp else (lambda y: y),
        )
        # gather_activation undoes split_activation, in value and gradient
        x_in = x.clone().requires_grad_()
        back = gather_activation(split_activation(x_in, ctx, sequence_parallel=sp), ctx, sequence_parallel=sp)
        torch.testing.assert_close(back, x, rtol=0, atol=0)
        (back * 3).sum().backward()
        torch.testing.assert_close(x_in.grad, torch.full_like(x, 3.0))
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_chain_matches_torch(pools, world, sequence_parallel):
    assert pools.run(world, body_mlp, {"tensor": world}, sequence_parallel) == [True] * world


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_chain_tp2_dp2(pools, sequence_parallel):
    assert pools.run(4, body_mlp, TP2_DP2, sequence_parallel) == [True] * 4


def body_sequence_parallel_errors():
    ctx = use_layout(tensor=2)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        split_activation(torch.zeros(2, 3, 4), ctx, sequence_parallel=True)
    row = Linear1D_Row(8, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 5 is not divisible"):
        row(torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="input_is_parallel"):
        Linear1D_Row(8, 4, input_is_parallel=False, sequence_parallel=True)
    return True


def test_sequence_parallel_rejects_uneven_sequence(pools):
    assert pools.run(2, body_sequence_parallel_errors) == [True] * 2


# ---- norms, embeddings, heads --------------------------------------------------------------


def body_layernorm(layout):
    ctx = use_layout(**layout)
    for h, bias in ((8, True), (_uneven(30, ctx.size("tensor")), False)):
        x = _randn(2, 4, h, seed=h)
        make_plain = partial(nn.LayerNorm, h, eps=1e-6, bias=bias)
        _compare(ctx, make_plain, partial(LayerNorm1D, h, eps=1e-6, bias=bias), x)
        _compare(
            ctx,
            make_plain,
            partial(LayerNorm1D, h, eps=1e-6, bias=bias, sequence_parallel=True),
            x,
            local_in=lambda x: split_activation(x, ctx, sequence_parallel=True),
            local_out=lambda y: _seq_part(y, ctx),
        )
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_layernorm_matches_torch(pools, world):
    assert pools.run(world, body_layernorm, {"tensor": world}) == [True] * world


def body_embeddings(layout):
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    for vocab, dim, pad in ((16, 8, None), (_uneven(50, P), _uneven(30, P), 3)):
        ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(vocab))
        ids[0, :2] = vocab - 1  # the last real row, next to the padding
        make_plain = partial(nn.Embedding, vocab, dim, padding_idx=pad)
        _compare(ctx, make_plain, partial(Embedding1D, vocab, dim, padding_idx=pad), ids)
        _compare(ctx, make_plain, partial(VocabParallelEmbedding1D, vocab, dim, padding_idx=pad), ids)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_embeddings_match_torch(pools, world):
    assert pools.run(world, body_embeddings, {"tensor": world}) == [True] * world


def body_classifiers(layout):
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    for fan_in, classes, bias in ((16, 10, True), (_uneven(30, P), 7, False)):
        x = _randn(2, 3, fan_in, seed=fan_in)
        _compare(ctx, partial(nn.Linear, fan_in, classes, bias=bias), partial(Classifier1D, fan_in, classes, bias), x)
    for fan_in, classes, bias in ((8, 16, False), (6, _uneven(50, P), True)):
        x = _randn(2, 3, fan_in, seed=classes)
        real = _real_entries(classes, ctx)

        def lowest_padded(y, real=real):  # padded classes hold the lowest logit
            local = _last_dim_block(y, ctx)
            local[..., real:] = torch.finfo(local.dtype).min
            return local

        _compare(
            ctx,
            partial(nn.Linear, fan_in, classes, bias=bias),
            partial(VocabParallelClassifier1D, fan_in, classes, bias),
            x,
            local_out=lowest_padded,
            local_upstream=lambda g: _last_dim_block(g, ctx),  # zero on padded classes
        )
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_classifiers_match_torch(pools, world):
    assert pools.run(world, body_classifiers, {"tensor": world}) == [True] * world


def body_patch_embedding(layout):
    ctx = use_layout(**layout)
    for img, patch, chans, embed in ((8, 4, 3, 16), (6, 3, 2, _uneven(30, ctx.size("tensor")))):
        images = _randn(2, chans, img, img, seed=embed)
        _compare(
            ctx,
            partial(PatchEmbedding, img, patch, chans, embed),
            partial(PatchEmbedding1D, img, patch, chans, embed),
            images,
        )
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_patch_embedding_matches_torch(pools, world):
    assert pools.run(world, body_patch_embedding, {"tensor": world}) == [True] * world


# ---- losses --------------------------------------------------------------------------------


def body_cross_entropy(layout):
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    for classes in (16, _uneven(50, P)):
        # large logits: without the max shift exp() overflows
        logits = _randn(3, 5, classes, seed=classes) * 40
        targets = torch.randint(0, classes, (3, 5), generator=torch.Generator().manual_seed(1))
        targets[0, 0], targets[1, 2] = -100, classes - 1  # an ignored token, the last class

        ref_logits = logits.clone().requires_grad_()
        ref = nn.CrossEntropyLoss()(ref_logits.flatten(0, 1), targets.flatten())
        ref.backward()

        full = logits.clone().requires_grad_()
        loss = CrossEntropyLoss1D()(full, targets)
        loss.backward()
        torch.testing.assert_close(loss, ref, **TOL)
        torch.testing.assert_close(full.grad, ref_logits.grad, **TOL)

        # split over classes, padded classes (here holding a huge logit) masked by num_classes
        real = _real_entries(classes, ctx)
        local = _last_dim_block(logits, ctx)
        local[..., real:] = 1000.0
        local.requires_grad_()
        loss = VocabParallelCrossEntropyLoss1D(num_classes=classes)(local, targets)
        loss.backward()
        torch.testing.assert_close(loss, ref, **TOL)
        assert local.grad is not None
        torch.testing.assert_close(local.grad, _last_dim_block(ref_logits.grad, ctx), **TOL)
        # padded classes holding the lowest logit (as VocabParallelClassifier1D leaves them)
        lowest = _last_dim_block(logits, ctx)
        lowest[..., real:] = torch.finfo(torch.float32).min
        torch.testing.assert_close(VocabParallelCrossEntropyLoss1D()(lowest, targets), ref, **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_cross_entropy_losses_match_torch(pools, world):
    assert pools.run(world, body_cross_entropy, {"tensor": world}) == [True] * world


class _TiedLM(nn.Module):
    def __init__(self, emb: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.emb, self.head = emb, head

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _plain_lm(vocab: int, dim: int, tied: bool) -> _TiedLM:
    model = _TiedLM(nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False))
    if tied:
        model.head.weight = model.emb.weight
    return model


def body_tied(layout):
    """A tied embedding / head: the shared weight's gradient is the sum of both uses."""
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    for vocab, dim in ((16, 8), (_uneven(50, P), _uneven(30, P))):
        ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(vocab))
        targets = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(dim))
        torch.manual_seed(3)
        plain = _plain_lm(vocab, dim, tied=True)
        ref = F.cross_entropy(plain(ids).flatten(0, 1), targets.flatten())
        ref.backward()
        untied = _plain_lm(vocab, dim, tied=False)  # each use's gradient on its own
        untied.emb.weight.data.copy_(plain.emb.weight.data)
        untied.head.weight.data.copy_(plain.emb.weight.data)
        F.cross_entropy(untied(ids).flatten(0, 1), targets.flatten()).backward()
        both_uses = untied.emb.weight.grad + untied.head.weight.grad
        torch.testing.assert_close(plain.emb.weight.grad, both_uses)

        vocab_emb = VocabParallelEmbedding1D(vocab, dim)
        vocab_lm = _TiedLM(vocab_emb, VocabParallelClassifier1D(dim, vocab, weight=vocab_emb.weight))
        dim_emb = Embedding1D(vocab, dim)
        dim_lm = _TiedLM(dim_emb, Classifier1D(dim, vocab, bias=False, weight=dim_emb.weight))
        for model, loss_fn in ((vocab_lm, VocabParallelCrossEntropyLoss1D()), (dim_lm, CrossEntropyLoss1D())):
            assert model.head.weight is model.emb.weight
            load_full_state_dict(model, plain.state_dict())
            loss = loss_fn(model(ids), targets)
            loss.backward()
            torch.testing.assert_close(loss, ref, **TOL)
            spec = spec_of(model.emb.weight)
            assert spec is not None
            torch.testing.assert_close(model.emb.weight.grad, local_shard(both_uses, spec, ctx), **TOL)
            _check_state_dict(model, plain)
    with pytest.raises(ValueError, match="tied weight"):
        VocabParallelClassifier1D(8, 16, weight=Embedding1D(16, 8).weight)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_tied_embedding_and_head(pools, world):
    assert pools.run(world, body_tied, {"tensor": world}) == [True] * world


# ---- dropout -------------------------------------------------------------------------------


def body_dropout(layout):
    ctx = use_layout(**layout)
    torch.manual_seed(11)  # the default stream, alike on every rank
    x = torch.ones(4, 64)
    split_mask = Dropout1D(0.5, parallel_input=True)(x)
    replicated_mask = Dropout1D(0.5)(x)
    assert set(split_mask.unique().tolist()) <= {0.0, 2.0}
    assert torch.equal(Dropout1D(0.0, parallel_input=True)(x), x)
    assert torch.equal(Dropout1D(0.0)(x), x)
    assert torch.equal(Dropout1D(0.5, parallel_input=True).eval()(x), x)
    return ctx.local_rank("data"), ctx.local_rank("tensor"), split_mask, replicated_mask


def test_dropout_masks_differ_exactly_along_tensor(pools):
    results = pools.run(4, body_dropout, TP2_DP2)
    split = {(d, t): m for d, t, m, _ in results}
    # a split input: masks differ across tensor ranks and agree across data replicas
    assert not torch.equal(split[(0, 0)], split[(0, 1)])
    assert torch.equal(split[(0, 0)], split[(1, 0)]) and torch.equal(split[(0, 1)], split[(1, 1)])
    # a replicated input: one mask everywhere
    assert all(torch.equal(results[0][3], r[3]) for r in results)


# ---- communication and memory --------------------------------------------------------------

F32 = 4


def body_ledger_and_memory(layout):
    ctx = use_layout(**layout)
    P = ctx.size("tensor")
    ring = Fraction(P - 1, P)
    b, s, fan_in, hidden, fan_out = 2, 4, 8, 12, 6
    torch.manual_seed(0)
    x = _randn(b, s, fan_in, seed=1)
    upstream = _randn(b, s, fan_out, seed=2)

    # Col -> Row, fwd + bwd: Row all-reduces its output [b, s, out] forward, Col all-reduces the
    # input gradient [b, s, in] backward:  2 (P-1)/P * 4 * b * s * (in + out) bytes per rank.
    col, row = Linear1D_Col(fan_in, hidden), Linear1D_Row(hidden, fan_out)
    x_in = x.clone().requires_grad_()
    with comm.ledger() as led:
        (row(col(x_in)) * upstream).sum().backward()
    expected = 2 * ring * F32 * b * s * (fan_in + fan_out)
    assert led.calls("all_reduce", "tensor") == 2 and led.calls() == 2, led
    assert led.bytes("all_reduce", "tensor") == expected and led.bytes() == expected, led

    # sequence parallel: all-gather [b, s, in] fwd and reduce-scatter its gradient bwd; reduce-
    # scatter [b, s, out] fwd and all-gather its gradient bwd; all-reduce Row's bias gradient.
    col, row = (
        Linear1D_Col(fan_in, hidden, sequence_parallel=True),
        Linear1D_Row(hidden, fan_out, sequence_parallel=True),
    )
    x_in = _seq_part(x, ctx).clone().requires_grad_()
    with comm.ledger() as led:
        (row(col(x_in)) * _seq_part(upstream, ctx)).sum().backward()
    each_way = ring * F32 * b * s * (fan_in + fan_out)
    assert led.bytes("all_gather", "tensor") == each_way, led
    assert led.bytes("reduce_scatter", "tensor") == each_way, led
    assert led.bytes("all_reduce", "tensor") == 2 * ring * F32 * fan_out, led
    assert led.bytes() == 2 * each_way + 2 * ring * F32 * fan_out, led

    # parameter bytes per rank: 1/P of the full (padded) weight
    for fan_in_, fan_out_ in ((fan_in, hidden), (6, _uneven(30, P))):
        col, row = Linear1D_Col(fan_in_, fan_out_), Linear1D_Row(fan_out_, fan_in_)
        padded = round_up(fan_out_, P) * fan_in_ * F32
        assert col.weight.numel() * col.weight.element_size() * P == padded
        assert row.weight.numel() * row.weight.element_size() * P == padded
        assert col.bias is not None and col.bias.numel() * P == round_up(fan_out_, P)
        assert row.bias is not None and row.bias.numel() == fan_in_  # replicated
    return True


@pytest.mark.parametrize(("world", "layout"), [(2, {"tensor": 2}), (4, {"tensor": 4}), (4, TP2_DP2)])
def test_ledger_and_parameter_bytes_follow_the_formula(pools, world, layout):
    assert pools.run(world, body_ledger_and_memory, layout) == [True] * world
