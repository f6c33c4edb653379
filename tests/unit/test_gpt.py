"""The reference GPT: shapes, causality, weight tying, GPT-2 parameter count, seeding, and that it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.models import GPT, PRESETS, GPTConfig, gpt


def small_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return gpt("tiny", **{"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 32, **overrides})


def test_logits_have_shape_batch_seq_vocab():
    model = small_model()
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)


def test_changing_later_tokens_leaves_earlier_logits_unchanged():
    model = small_model().eval()
    idx = torch.randint(0, 256, (2, 32))
    t = 11
    changed = idx.clone()
    changed[:, t:] = (changed[:, t:] + 1 + torch.randint(0, 255, changed[:, t:].shape)) % 256
    assert not torch.equal(idx[:, t:], changed[:, t:])
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t])
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_tied_head_shares_storage_and_is_counted_once():
    tied = small_model()
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    untied = small_model(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    head = untied.lm_head.weight.numel()
    assert untied.num_parameters() == tied.num_parameters() + head
    assert tied.num_parameters() == sum(p.numel() for p in tied.state_dict().values()) - head


def test_gpt2_preset_has_124m_parameters():
    with torch.device("meta"):
        model = gpt("gpt2")
    assert model.num_parameters() == 124_439_808


@pytest.mark.parametrize(
    ("name", "width", "layers", "heads"),
    [("gpt2-medium", 1024, 24, 16), ("gpt2-large", 1280, 36, 20), ("gpt2-xl", 1600, 48, 25)],
)
def test_larger_gpt2_presets_have_the_published_shapes(name, width, layers, heads):
    config = PRESETS[name]
    assert (config.vocab_size, config.max_seq_len) == (50257, 1024)
    assert (config.d_model, config.n_layers, config.n_heads, config.ff_dim) == (width, layers, heads, 4 * width)


def test_residual_projections_get_the_smaller_init():
    model = gpt("tiny", n_layers=8)
    block = model.blocks[0]
    expected = 0.02 / (2 * 8) ** 0.5
    assert block.attn.out.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert block.mlp.proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.count_nonzero(block.attn.qkv.bias) == 0


def test_same_seed_gives_identical_weights():
    first, second = small_model(), small_model()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    torch.manual_seed(1)
    third = gpt("tiny", n_layers=2, d_model=64, n_heads=4, max_seq_len=32)
    assert not torch.equal(first.tok_emb.weight, third.tok_emb.weight)


def test_tiny_preset_overfits_one_batch():
    torch.manual_seed(0)
    model = gpt("tiny")
    batch = torch.randint(0, 256, (4, 65))
    x, y = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses


def test_overrides_replace_fields_and_d_ff_follows_d_model():
    model = gpt("tiny", n_layers=2, d_model=64)
    assert model.config.n_layers == 2 and len(model.blocks) == 2
    assert model.blocks[0].mlp.fc.out_features == 4 * 64
    assert gpt("tiny", n_layers=1, d_ff=100).blocks[0].mlp.fc.out_features == 100
    assert PRESETS["tiny"].n_layers == 4  # the preset itself is untouched


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"'gpt3'.*tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        gpt("gpt3")


def test_unknown_override_names_the_field():
    with pytest.raises(ValueError, match="n_layer\\b"):
        gpt("tiny", n_layer=2)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(d_model=100, n_heads=3), "d_model=100 must be divisible by n_heads=3"),
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(d_ff=0), "d_ff"),
        (dict(dropout=1.0), "dropout"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    ],
)
def test_bad_config_raises_naming_the_field(fields, named):
    base = dict(vocab_size=256, max_seq_len=16, d_model=64, n_layers=1, n_heads=4)
    with pytest.raises(ValueError, match=named):
        GPTConfig(**{**base, **fields})


def test_sequence_longer_than_max_seq_len_raises():
    model = small_model()
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_dropout_only_acts_in_training():
    model = small_model(dropout=0.5)
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), model(idx))
    model.train()
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx))
