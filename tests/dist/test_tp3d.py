"""3D tensor-parallel layers on a 2 x 2 x 2 cube (8 ranks), checked against plain torch layers.

Each layer's forward output and its input, weight and bias gradients are compared with the
single-process layer (fp32) for an even shape and uneven ones: hidden 31, 30, 29 and 23 on q = 2
(padded to a multiple of q^2 and split as plain q^2 blocks, see "Uneven sizes" in ``tp3d.py``),
batch 5 and 3, vocabulary 50.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tessera import comm
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.nn import plain
from tessera.parallel.tensor import tp3d
from tessera.parallel.tensor.common import ShardSpec, local_shard, spec_of
from tessera.testing import tolerance, use_layout

LAYOUT = dict(tensor=8, mode="3d")
RANKS = 8
INPUT, WEIGHT, OUTPUT = "3d_input", "3d_weight", "3d_output"
# a layer (or a block's pieces) forward and backward, against the single-process one
RTOL = ATOL = tolerance(depth=2 * 8)["rtol"]


def _fine(h: int, q: int) -> int:
    """Hidden units per rank: ``h`` padded to a multiple of q^2, split q^2 ways."""
    return -(-h // (q * q))


class Setup:
    """The cube in force on this rank and how to cut full reference tensors to its blocks."""

    def __init__(self) -> None:
        self.ctx = use_layout(**LAYOUT)
        self.q = self.ctx.size(INPUT)
        self.w, self.n, self.o = (self.ctx.local_rank(a) for a in (WEIGHT, INPUT, OUTPUT))

    def layer(self, name: str, *args: Any, **kwargs: Any) -> nn.Module:
        return getattr(tp3d, name + "3D")(*args, ctx=self.ctx, **kwargs)

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """Batch block ``w`` of a full tensor, zero-padded."""
        per = math.ceil(full.shape[0] / self.q)
        padded = torch.cat([full, full.new_zeros(per * self.q - full.shape[0], *full.shape[1:])])
        return padded[self.w * per : (self.w + 1) * per]

    def real_rows(self, batch: int) -> int:
        per = math.ceil(batch / self.q)
        return max(0, min(per, batch - self.w * per))

    def hidden(self, full: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """Block ``o*q + n`` of each of ``groups`` parts of the last dimension, each part
        zero-padded to a multiple of q^2 and split q^2 ways."""
        parts = full.unflatten(-1, (groups, full.shape[-1] // groups))
        h, f = parts.shape[-1], _fine(parts.shape[-1], self.q)
        padded = torch.cat([parts, parts.new_zeros(*parts.shape[:-1], self.q**2 * f - h)], dim=-1)
        return padded[..., (self.o * self.q + self.n) * f :][..., :f].flatten(-2)

    def local(self, full: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """This rank's block of a full activation (batch first)."""
        return self.hidden(self.rows(full.detach()), groups)

    def classes(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of full logits split over classes: batch block ``w``, classes block
        ``o*q + n`` of ``ceil(C/q^2)`` (a plain ShardSpec)."""
        dims = ((WEIGHT,), *([()] * (full.dim() - 2)), (OUTPUT, INPUT))
        return local_shard(full.detach(), ShardSpec(tuple(full.shape), dims), self.ctx)

    def valid_classes(self, classes: int) -> int:
        per = math.ceil(classes / self.q**2)
        return max(0, min(per, classes - (self.o * self.q + self.n) * per))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ids(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _check_param_grads(s: Setup, parallel: nn.Module, reference: nn.Module) -> None:
    ref_grads = {k: p.grad for k, p in reference.named_parameters(remove_duplicate=False)}
    for name, p in parallel.named_parameters(remove_duplicate=False):
        expected = ref_grads[name]
        assert expected is not None and p.grad is not None, name
        spec = spec_of(p)
        _close(p.grad, local_shard(expected, spec, s.ctx) if spec is not None else expected, f"grad {name}")
        if spec is not None:  # padded entries stay zero
            padding = local_shard(torch.ones(spec.full_shape), spec, s.ctx) == 0
            assert not p.grad[padding].any() and not p.detach()[padding].any(), f"padding of {name}"


def _check_state(parallel: nn.Module, reference: nn.Module) -> None:
    full, ref = full_state_dict(parallel), reference.state_dict()
    assert full.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(full[key], ref[key], rtol=0, atol=0, msg=key)


def _run_activation_layer(
    s: Setup, parallel: nn.Module, reference: nn.Module, x_full: torch.Tensor, groups: int = 1
) -> None:
    """Feed the full input through split_activation (and the reference), compare this rank's
    output block on the real rows and every gradient after backward of ``(out * R).sum()``."""
    load_full_state_dict(parallel, reference.state_dict())
    x_ref = x_full.clone().requires_grad_()
    out_ref = reference(x_ref)
    upstream = _rand(*out_ref.shape, seed=7)
    (out_ref * upstream).sum().backward()

    x = x_full.clone().requires_grad_()
    x_local = tp3d.split_activation(x, s.ctx)
    x_local.retain_grad()
    out = parallel(x_local)
    rows = s.real_rows(x_full.shape[0])
    expected = s.local(out_ref, groups)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    _close(out[:rows], expected[:rows], "output")
    (out * s.local(upstream, groups)).sum().backward()
    _close(x.grad, x_ref.grad, "input grad")
    padding = s.local(torch.ones_like(x_full)) == 0
    assert not x_local.grad[padding].any(), "padded input units must get no gradient"
    assert not out[:rows][s.local(torch.ones_like(out_ref), groups)[:rows] == 0].any(), "padded outputs are zero"
    _check_param_grads(s, parallel, reference)
    _check_state(parallel, reference)


# ---- bodies (run on every rank) ---------------------------------------------------------------


def body_linear(batch, seq, fin, fout, **options):
    """``options``: the layers' ``keep_blocks`` (default: the layer's own, the gathered weight kept)."""
    s = Setup()
    torch.manual_seed(0)
    par = s.layer("Linear", fin, fout, **options)
    _run_activation_layer(s, par, nn.Linear(fin, fout), _rand(batch, seq, fin, seed=1))
    # no sequence dimension, no bias
    ref = nn.Linear(fin, fout, bias=False)
    _run_activation_layer(s, s.layer("Linear", fin, fout, bias=False, **options), ref, _rand(batch, fin, seed=2))
    # fused outputs (q, k, v): each part split on its own
    fused = s.layer("Linear", fin, 3 * fout, out_groups=3, **options)
    _run_activation_layer(s, fused, nn.Linear(fin, 3 * fout), _rand(batch, seq, fin, seed=3), groups=3)
    return True


def body_layer_norm(batch, seq, hidden):
    s = Setup()
    for bias in (True, False):
        ref = nn.LayerNorm(hidden, bias=bias)
        with torch.no_grad():
            ref.weight.copy_(1 + 0.1 * _rand(hidden, seed=4))
            if bias:
                ref.bias.copy_(_rand(hidden, seed=5))
        x = 3 + 2 * _rand(batch, seq, hidden, seed=6)
        _run_activation_layer(s, s.layer("LayerNorm", hidden, bias=bias), ref, x)
    return True


class _Chain(nn.Module):
    """``x + fc2(norm(fc1(x)))``: Linear -> LayerNorm -> Linear and a residual add."""

    def __init__(self, fc1: nn.Module, norm: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = fc1, norm, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.norm(self.fc1(x)))


def body_chain(batch, seq, hidden, inner):
    s = Setup()
    torch.manual_seed(5)
    ref = _Chain(nn.Linear(hidden, inner), nn.LayerNorm(inner), nn.Linear(inner, hidden))
    with torch.no_grad():
        ref.norm.weight.copy_(1 + 0.1 * _rand(inner, seed=21))
        ref.norm.bias.copy_(_rand(inner, seed=22))
    par = _Chain(s.layer("Linear", hidden, inner), s.layer("LayerNorm", inner), s.layer("Linear", inner, hidden))
    _run_activation_layer(s, par, ref, _rand(batch, seq, hidden, seed=23))
    return True


def body_split_gather(batch, seq, hidden):
    s = Setup()
    x = _rand(batch, seq, hidden, seed=8).requires_grad_()
    local = tp3d.split_activation(x, s.ctx)
    assert local.shape == (math.ceil(batch / s.q), seq, _fine(hidden, s.q))
    _close(local, s.local(x), "split")
    spec = ShardSpec(tuple(x.shape), ((WEIGHT,), (), (OUTPUT, INPUT)))  # a plain q^2 block, any size
    _close(local, local_shard(x.detach(), spec, s.ctx), "split as a ShardSpec")
    back = tp3d.gather_activation(local, s.ctx, full_shape=x.shape)
    _close(back, x.detach(), "gather")
    upstream = _rand(batch, seq, hidden, seed=9)
    (back * upstream).sum().backward()  # every rank backpropagates its own copy
    _close(x.grad, upstream, "round-trip grad")
    assert tp3d.hidden_parts(s.ctx) == s.q**2 and tp3d.batch_parts(s.ctx) == s.q
    return True


def body_embeddings(batch, seq, vocab, dim):
    s = Setup()
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
        assert out.shape == (math.ceil(batch / s.q), seq, _fine(dim, s.q)), (name, out.shape)
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


def body_classifiers(batch, seq, hidden, classes, keep_blocks=None):
    """Classifier + CrossEntropyLoss and VocabParallelClassifier + VocabParallelCrossEntropyLoss
    against Linear + torch CE; tied embedding/head pairs against tied references.
    ``keep_blocks``: the vocabulary-parallel heads' (default: the layer's own)."""
    s = Setup()
    keep = {} if keep_blocks is None else {"keep_blocks": keep_blocks}
    targets = _ids(batch, seq, classes, seed=12)
    targets[0, 0] = -100  # an ignored target
    ce = nn.CrossEntropyLoss()
    rows = s.real_rows(batch)
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
            ref_logits = ref(x_ref)
            loss_ref = ce(ref_logits.flatten(0, 1), targets.flatten())
            loss_ref.backward()
            x = x_full.clone().requires_grad_()
            logits = par(tp3d.split_activation(x, s.ctx))
            if name == "Classifier":  # every class on every rank
                _close(logits[:rows], s.rows(ref_logits.detach())[:rows], "classifier logits")
            else:
                valid = s.valid_classes(classes)
                assert logits.shape[-1] == math.ceil(classes / s.q**2)
                _close(logits[:rows, :, :valid], s.classes(ref_logits)[:rows, :, :valid], "vocab-parallel logits")
            loss = s.layer(loss_name)(logits, targets)
            _close(loss, loss_ref.detach(), f"{loss_name} value")
            loss.backward()
            _close(x.grad, x_ref.grad, f"{name} input grad")
            _check_param_grads(s, par, ref)
            _check_state(par, ref)

    # tied heads: the shared weight's gradient sums the embedding's and the head's parts
    for emb_name, head_name, loss_name in (
        ("VocabParallelEmbedding", "VocabParallelClassifier", "VocabParallelCrossEntropyLoss"),
        ("Embedding", "Classifier", "CrossEntropyLoss"),
    ):
        torch.manual_seed(3)
        ref_lm = _TiedLM(nn.Embedding(classes, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, classes, bias=False))
        ref_lm.head.weight = ref_lm.emb.weight
        emb = s.layer(emb_name, classes, hidden)
        head_keep = keep if head_name != "Classifier" else {}
        head = s.layer(head_name, hidden, classes, bias=False, weight=emb.weight, **head_keep)
        par_lm = _TiedLM(emb, s.layer("LayerNorm", hidden), head)
        assert par_lm.head.weight is par_lm.emb.weight
        load_full_state_dict(par_lm, ref_lm.state_dict())
        loss_ref = ce(ref_lm(targets.clamp(min=0)).flatten(0, 1), targets.flatten())
        loss_ref.backward()
        loss = s.layer(loss_name)(par_lm(targets.clamp(min=0)), targets)
        _close(loss, loss_ref.detach(), f"tied {head_name} loss")
        loss.backward()
        _check_param_grads(s, par_lm, ref_lm)
        _check_state(par_lm, ref_lm)
    with pytest.raises(ValueError, match="tied weight"):
        s.layer("VocabParallelClassifier", hidden, classes, weight=s.layer("Embedding", classes, hidden).weight)
    return True


def body_cross_entropy_2d_logits(batch, classes):
    """The losses on ``[b, C]`` logits (no sequence), fed directly."""
    s = Setup()
    full = _rand(batch, classes, seed=14)
    targets = _ids(batch, 1, classes, seed=15).flatten()
    ref = full.clone().requires_grad_()
    loss_ref = nn.functional.cross_entropy(ref, targets)
    loss_ref.backward()
    rows = s.real_rows(batch)
    for loss_name, cut in (("CrossEntropyLoss", s.rows), ("VocabParallelCrossEntropyLoss", s.classes)):
        local = cut(full).clone().requires_grad_()
        kwargs = {"num_classes": classes} if loss_name.startswith("Vocab") else {}
        loss = s.layer(loss_name, **kwargs)(local, targets)
        _close(loss, loss_ref.detach(), f"{loss_name} value")
        loss.backward()
        _close(local.grad[:rows], cut(ref.grad)[:rows], f"{loss_name} grad")
    return True


def body_patch_embedding(batch, embed):
    s = Setup()
    torch.manual_seed(4)
    ref = plain.PatchEmbedding(8, 4, 3, embed)
    with torch.no_grad():
        ref.cls_token.copy_(_rand(1, 1, embed, seed=16))
    par = s.layer("PatchEmbedding", 8, 4, 3, embed)
    load_full_state_dict(par, ref.state_dict())
    images = _rand(batch, 3, 8, 8, seed=17)
    images_ref = images.clone().requires_grad_()
    out_ref = ref(images_ref)
    upstream = _rand(*out_ref.shape, seed=18)
    (out_ref * upstream).sum().backward()
    images = images.clone().requires_grad_()
    out = par(images)
    rows = s.real_rows(batch)
    _close(out[:rows], s.local(out_ref)[:rows], "patch embedding output")
    (out * s.local(upstream)).sum().backward()
    _close(images.grad, images_ref.grad, "image grad")
    _check_param_grads(s, par, ref)
    _check_state(par, ref)
    return True


def body_dropout():
    s = Setup()
    x = torch.ones(4, 3, 6)
    assert s.layer("Dropout", 0.0)(x) is x
    drop = s.layer("Dropout", 0.5)
    out = drop(x)
    mask = out != 0
    assert 0 < mask.sum() < mask.numel()
    _close(out[mask], torch.full_like(x, 2.0)[mask], "kept values scaled by 1/(1-p)")
    assert not torch.equal(drop(x) != 0, mask), "the stream moves on between calls"
    drop.eval()
    assert drop(x) is x
    after = torch.rand(4)  # the default stream is untouched: it still agrees across the group
    return mask, after


def body_linear_ledger(batch, seq, fin, fout):
    """Logical bytes of one Linear forward + backward per (op, axis), against the formula; and
    the parameter bytes per rank."""
    s = Setup()
    q = s.q
    layer = s.layer("Linear", fin, fout)
    x = s.local(_rand(batch, seq, fin, seed=19)).requires_grad_()  # a local block
    with comm.ledger() as led:
        y = layer(x)
        (y * _rand(*y.shape, seed=20)).sum().backward()
    e = 4  # fp32
    f_in, f_out = _fine(fin, q), _fine(fout, q)  # in and out padded to multiples of q^2
    x_o = math.ceil(batch / q) * seq * q * f_in * e  # X gathered along 3d_input: [b/q, s, in/q]
    w_o = q * f_out * q * f_in * e  # W gathered along 3d_weight: [out/q, in/q]
    y_o = math.ceil(batch / q) * seq * q * f_out * e  # the output before its reduce-scatter: [b/q, s, out/q]
    ring = (q - 1) / q
    expected = {
        ("all_gather", INPUT): ring * x_o,  # X forward
        ("reduce_scatter", INPUT): ring * x_o,  # dX backward
        ("all_gather", WEIGHT): ring * w_o,  # W forward
        ("reduce_scatter", WEIGHT): ring * w_o,  # dW backward (sums the batch blocks)
        ("reduce_scatter", OUTPUT): ring * y_o,  # Y forward (sums the in blocks)
        ("all_gather", OUTPUT): ring * y_o,  # dY backward
        ("all_reduce", WEIGHT): 2 * ring * f_out * e,  # bias gradient over the batch blocks
    }
    got = {key: v["bytes"] for key, v in led.summary().items()}
    assert got.keys() == expected.keys(), got
    for key, value in got.items():
        assert math.isclose(value, expected[key]), (key, value, expected[key])
    if batch % q == 0 and fin % q**2 == 0 and fout % q**2 == 0:  # the textbook 3D cost
        textbook = 2 * (q - 1) / q**3 * e * (batch * seq * (fin + fout) + fin * fout + fout)
        assert math.isclose(led.bytes(), textbook), (led.bytes(), textbook)
    # memory: 1/q^3 of the padded full weight [q^2 F_out, q^2 F_in] (without padding, of the weight)
    spec = spec_of(layer.weight)
    assert spec is not None
    assert (spec.padded_size(0, s.ctx), spec.padded_size(1, s.ctx)) == (q**2 * f_out, q**2 * f_in)
    assert tuple(layer.weight.shape) == (f_out, q * f_in)
    assert layer.weight.numel() * q**3 == spec.padded_size(0, s.ctx) * spec.padded_size(1, s.ctx)
    if fin % q**2 == 0 and fout % q**2 == 0:
        assert layer.weight.numel() * layer.weight.element_size() * q**3 == fin * fout * e
    return led.bytes()


# ---- tests -------------------------------------------------------------------------------------

# (batch, seq, in, out): even; uneven (31 -> 32, 23 -> 24, 30 -> 32, 50 -> 52); 29 in and out
LINEAR_SHAPES = [(4, 3, 16, 32), (3, 2, 31, 23), (5, 2, 30, 50), (3, 2, 29, 29)]


class _FakeRank:
    """Rank ``(w, n, o)`` of a q^3 cube, as much of a context as ``local_shard`` asks of."""

    def __init__(self, q: int, w: int, n: int, o: int) -> None:
        self.q, self.ranks = q, {WEIGHT: w, INPUT: n, OUTPUT: o}

    def size(self, axis: str) -> int:
        return self.q

    def local_rank(self, axis: str) -> int:
        return self.ranks[axis]


def _block(full: torch.Tensor, spec: ShardSpec, q: int, w: int, n: int, o: int) -> torch.Tensor:
    return local_shard(full, spec, _FakeRank(q, w, n, o))  # type: ignore[arg-type]


def test_linear_blocks_line_up_with_the_activation_blocks():
    """No processes: for every size, a Linear's in block ``o`` is the union of the activation
    blocks ``o*q + n'`` (what the all-gather along 3d_input gives), and chunk ``o`` of its out rows
    gathered along 3d_weight (blocks ``w'*q + n``) is the activation block ``o*q + n``."""
    for q in (2, 3):
        for h in (1, 7, 16, 29, 30, 31, 50):
            units = torch.arange(1.0, h + 1)  # nonzero: padding shows as 0
            act = tp3d.hidden_spec((h,), 0)
            w_in = tp3d.weight_spec(q * q, h, q)  # every rank one real row holding every in unit
            w_out = tp3d.weight_spec(h, q * q, q)  # in not padded: each row's entries are its unit
            f = _fine(h, q)
            for w, n, o in ((w, n, o) for w in range(q) for n in range(q) for o in range(q)):
                mine = _block(units, act, q, w, n, o)
                assert mine.shape == (f,)
                coarse = torch.cat([_block(units, act, q, w, m, o) for m in range(q)])
                assert torch.equal(_block(units.expand(q * q, h), w_in, q, w, n, o)[0], coarse), (q, h)
                rows = [_block(units[:, None].expand(h, q * q), w_out, q, v, n, o)[:, 0] for v in range(q)]
                assert torch.equal(torch.cat(rows)[o * f : (o + 1) * f], mine), (q, h)


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_matches_torch(pools, shape):
    assert pools.run(RANKS, body_linear, *shape) == [True] * RANKS


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_regathering_its_weight_in_backward_matches_torch(pools, shape):
    assert pools.run(RANKS, body_linear, *shape, keep_blocks=False) == [True] * RANKS


@pytest.mark.parametrize("shape", [(4, 3, 16, 16), (5, 2, 30, 50)])
def test_vocab_parallel_heads_regathering_their_weight_match_torch(pools, shape):
    assert pools.run(RANKS, body_classifiers, *shape, keep_blocks=False) == [True] * RANKS


@pytest.mark.parametrize("hidden", [16, 31, 29])
def test_layer_norm_matches_torch(pools, hidden):
    assert pools.run(RANKS, body_layer_norm, 5, 2, hidden) == [True] * RANKS


@pytest.mark.parametrize("shape", [(4, 3, 16, 32), (5, 2, 30, 29)])
def test_linear_layernorm_linear_chain_with_residual(pools, shape):
    assert pools.run(RANKS, body_chain, *shape) == [True] * RANKS


@pytest.mark.parametrize("shape", [(4, 3, 16), (3, 2, 31), (5, 2, 30), (3, 2, 29)])
def test_split_gather_round_trip(pools, shape):
    assert pools.run(RANKS, body_split_gather, *shape) == [True] * RANKS


@pytest.mark.parametrize("shape", [(4, 3, 16, 16), (5, 2, 50, 30)])
def test_embeddings_match_torch(pools, shape):
    assert pools.run(RANKS, body_embeddings, *shape) == [True] * RANKS


@pytest.mark.parametrize("shape", [(4, 3, 16, 16), (5, 2, 30, 50)])
def test_classifiers_losses_and_tied_heads_match_torch(pools, shape):
    assert pools.run(RANKS, body_classifiers, *shape) == [True] * RANKS


def test_losses_on_unsequenced_logits(pools):
    assert pools.run(RANKS, body_cross_entropy_2d_logits, 5, 50) == [True] * RANKS


@pytest.mark.parametrize("embed", [16, 30])
def test_patch_embedding_matches_reference(pools, embed):
    assert pools.run(RANKS, body_patch_embedding, 5, embed) == [True] * RANKS


def test_dropout_masks_differ_per_rank_and_keep_the_default_stream(pools):
    results = pools.run(RANKS, body_dropout)
    masks = [m for m, _ in results]
    for a in range(RANKS):  # every axis of the cube splits the activations: no two ranks agree
        for b in range(a + 1, RANKS):
            assert not torch.equal(masks[a], masks[b]), (a, b)
    assert all(torch.equal(after, results[0][1]) for _, after in results)


@pytest.mark.parametrize("shape", [(4, 3, 16, 32), (5, 2, 29, 50)])
def test_linear_ledger_matches_the_3d_formula(pools, shape):
    # per rank: (q-1)/q (2|X_o| + 2|W_o| + 2|Y_o|) + the bias all-reduce, with X_o, W_o, Y_o the
    # gathered input, gathered weight and un-scattered output blocks (b padded to a multiple of q,
    # in and out to multiples of q^2); unpadded that is
    # 2 (q-1)/q^3 e (b s (in + out) + in out + out) (see body_linear_ledger)
    assert len(set(pools.run(RANKS, body_linear_ledger, *shape))) == 1
