"""tessera.rlhf.models in one process: value models on a tiny tessera GPT and on tiny Hugging Face
GPT-2 and LLaMA models built from configs (values per position, the padding after a row leaving
its values alone, the backbone the source model's, the head's seeded initialisation, loading
the backbone from a causal LM's state), sequence_values, and the token log-probs of
vocabulary-split logits with one rank (the several-rank cases are in tests/dist)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import tessera
from tessera.checkpoint import full_state_dict
from tessera.comm import AxisGroup
from tessera.errors import NotAvailableError
from tessera.models import gpt
from tessera.rlhf import pairwise_reward_loss, token_logprobs
from tessera.rlhf.models import (
    GPTValueModel,
    HFValueModel,
    sequence_values,
    token_logprobs_fn,
    value_head,
    value_model,
    vocab_parallel_token_logprobs,
)
from tessera.testing import tolerance, use_layout

VOCAB, SEQ, D = 67, 12, 32


def tiny_gpt(seed: int = 0):
    torch.manual_seed(seed)
    return gpt("tiny", vocab_size=VOCAB, max_seq_len=SEQ, d_model=D, n_layers=2, n_heads=4)


def tiny_hf(family: str, seed: int = 0):
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def ids(batch: int = 3, length: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def right_padded(tokens: torch.Tensor, lengths: list[int], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.arange(tokens.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return torch.where(mask, tokens, torch.full_like(tokens, pad)), mask.long()


# ---- the GPT --------------------------------------------------------------------------------


def test_a_gpt_value_model_gives_a_float32_value_per_position():
    model = value_model(tiny_gpt())
    values = model(ids())
    assert isinstance(model, GPTValueModel)
    assert values.shape == (3, 10) and values.dtype == torch.float32
    assert values.std() > 0  # the head is not a zero one by default


def test_the_gpt_backbone_is_the_gpts_own_modules_without_its_lm_head():
    source = tiny_gpt()
    before = full_state_dict(source)
    model = value_model(source)
    assert model.tok_emb is source.tok_emb and model.blocks is source.blocks and model.ln_f is source.ln_f
    state = full_state_dict(model)
    backbone = {k: v for k, v in before.items() if not k.startswith("lm_head.")}
    assert set(state) == set(backbone) | {"score.weight", "score.bias"}
    for key, value in backbone.items():
        assert torch.equal(state[key], value), key
    assert not any(name.startswith("lm_head") for name, _ in model.named_modules())


def test_a_preset_name_builds_a_new_gpt_with_overrides():
    model = value_model("tiny", vocab_size=VOCAB, max_seq_len=SEQ, d_model=D, n_layers=1, n_heads=4)
    assert len(model.blocks) == 1 and model.config.d_model == D
    with pytest.raises(TypeError, match="preset name only"):
        value_model(tiny_gpt(), n_layers=1)
    with pytest.raises(TypeError, match="GPT preset name, a tessera GPT or a transformers model"):
        value_model(torch.nn.Linear(2, 2))


def test_the_values_are_the_head_on_the_gpts_final_hidden_states():
    source = tiny_gpt()
    x = ids()
    hidden = {}
    hook = source.ln_f.register_forward_hook(lambda module, args, out: hidden.setdefault("h", out))
    source(x)  # the GPT's own forward records ln_f's output
    hook.remove()
    model = value_model(source)
    expected = hidden["h"] @ model.score.weight.squeeze(0) + model.score.bias
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("family", ["gpt", "gpt2", "llama"])
def test_padding_after_a_row_leaves_its_values_alone(family):
    model = value_model(tiny_gpt() if family == "gpt" else tiny_hf(family))
    tokens = ids(batch=3, length=10)
    lengths = [10, 6, 3]
    padded, mask = right_padded(tokens, lengths)
    other_padding, _ = right_padded(tokens, lengths, pad=VOCAB - 1)
    values = model(padded, attention_mask=mask)
    torch.testing.assert_close(model(other_padding, attention_mask=mask) * mask, values * mask)
    for row, length in enumerate(lengths):  # each row alone, unpadded
        alone = model(tokens[row : row + 1, :length])
        torch.testing.assert_close(values[row, :length], alone[0], **tolerance(blocks=2))  # another batch shape


def test_under_bf16_autocast_the_head_runs_in_float32():
    model = value_model(tiny_gpt())
    x = ids()
    seen = {}
    model.score.register_forward_hook(lambda module, args, out: seen.update(dtype=(args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = model(x)
    assert seen["dtype"] == (torch.float32, torch.float32) and values.dtype == torch.float32
    torch.testing.assert_close(values, model(x), rtol=0.05, atol=0.05)


def test_the_gpt_refuses_a_left_padded_mask():
    model = value_model(tiny_gpt())
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        model(ids(batch=2, length=3), attention_mask=mask)


def test_a_value_model_is_not_cut_into_pipeline_stages_yet():
    with pytest.raises(NotAvailableError, match="pipeline stages are not available for value models"):
        value_model(tiny_gpt()).pipeline_layers()


def test_gradients_of_a_pairwise_loss_reach_the_head_and_the_backbone_but_not_the_bias():
    model = value_model(tiny_gpt())
    padded, mask = right_padded(ids(batch=4), [10, 7, 9, 5])
    last = mask.sum(dim=1) - 1
    rewards = sequence_values(model(padded, attention_mask=mask), last)
    loss, _ = pairwise_reward_loss(*rewards.chunk(2))
    loss.backward()
    assert torch.equal(model.score.bias.grad, torch.zeros(1))  # a shift of every reward cancels out
    for name, param in model.named_parameters():
        if name != "score.bias":
            assert param.grad is not None and param.grad.abs().sum() > 0, name


# ---- the head -------------------------------------------------------------------------------


def test_the_head_is_drawn_from_its_seed_not_the_global_stream():
    torch.manual_seed(123)
    first = value_head(D, seed=5)
    torch.randn(1000)  # whatever was drawn before
    second = value_head(D, seed=5)
    drawn = torch.randn((1, D), generator=torch.Generator().manual_seed(5))
    expected = drawn * (1.0 / math.sqrt(D + 1))
    assert torch.equal(first.weight, expected) and torch.equal(second.weight, expected)
    assert torch.equal(first.bias, torch.zeros(1))
    assert not torch.equal(value_head(D, seed=6).weight, expected)
    assert torch.equal(value_head(D, std=0.0).weight, torch.zeros(1, D))
    assert torch.equal(value_head(D, std=0.5, seed=5).weight, drawn * 0.5)
    with pytest.raises(ValueError, match="std must be >= 0"):
        value_head(D, std=-1.0)


def test_value_models_on_the_same_seed_have_the_same_head_whatever_the_backbone():
    a = value_model(tiny_gpt(0), head_seed=3)
    b = value_model(tiny_hf("gpt2"), head_seed=3)
    assert torch.equal(a.score.weight, b.score.weight)
    assert torch.equal(value_model(tiny_gpt(0), head_std=0.0).score.weight, torch.zeros(1, D))


def test_a_deferred_value_model_is_made_with_the_values_of_a_plain_one():
    expected = full_state_dict(value_model(tiny_gpt(), head_seed=2))
    with tessera.deferred_init():
        model = value_model(tiny_gpt(), head_seed=2)
    assert model.score.weight.is_meta and model.tok_emb.weight.is_meta
    use_layout(config={})
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    made = full_state_dict(engine)
    assert set(made) == set(expected)
    for key, value in expected.items():
        assert torch.equal(made[key], value), key


def test_load_backbone_starts_a_reward_model_from_a_causal_lm():
    sft = tiny_gpt(seed=1)
    with torch.no_grad():
        sft.ln_f.weight.add_(0.5)  # "trained"
    model = value_model(tiny_gpt(seed=2), head_seed=4)
    head = model.score.weight.detach().clone()
    model.load_backbone(full_state_dict(sft))
    for key, value in full_state_dict(model).items():
        if key.startswith("score."):
            continue
        assert torch.equal(value, full_state_dict(sft)[key]), key
    assert torch.equal(model.score.weight, head)
    with pytest.raises(KeyError, match="missing"):
        model.load_backbone({k: v for k, v in full_state_dict(sft).items() if k != "ln_f.weight"})


# ---- Hugging Face models --------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_transformers_value_model_keeps_the_causal_lms_keys_and_drops_its_head(family):
    lm = tiny_hf(family)
    model = value_model(lm)
    assert isinstance(model, HFValueModel)
    prefix = lm.base_model_prefix
    assert model.backbone is lm.base_model
    lm_keys = {k for k in lm.state_dict() if not k.startswith("lm_head.")}
    assert set(model.state_dict()) == lm_keys | {"score.weight", "score.bias"}
    x = ids()
    values = model(x, attention_mask=torch.ones_like(x))
    hidden = lm(x, output_hidden_states=True).hidden_states[-1]  # after the final norm
    torch.testing.assert_close(values, (hidden @ model.score.weight.T + model.score.bias).squeeze(-1))
    assert values.dtype == torch.float32 and prefix in {"transformer", "model"}


def test_a_transformers_base_model_serves_too():
    base = tiny_hf("llama").model
    model = value_model(base)
    assert model.backbone is base and set(model.state_dict()) >= {"model.embed_tokens.weight", "score.weight"}
    assert model(ids()).shape == (3, 10)


# ---- sequence_values ------------------------------------------------------------------------


def test_sequence_values_reads_each_row_at_its_last_index():
    values = torch.arange(12.0).view(3, 4)
    torch.testing.assert_close(sequence_values(values, torch.tensor([3, 0, 2])), torch.tensor([3.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match="must lie in"):
        sequence_values(values, torch.tensor([4, 0, 0]))
    with pytest.raises(ValueError, match="one value per sequence"):
        sequence_values(values, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="integer"):
        sequence_values(values, torch.tensor([1.0, 2.0, 0.0]))


# ---- token log-probs ------------------------------------------------------------------------


def test_a_model_on_one_rank_takes_the_plain_token_logprobs():
    assert token_logprobs_fn(tiny_gpt()) is token_logprobs
    assert token_logprobs_fn(tiny_hf("gpt2")) is token_logprobs


def test_vocab_parallel_token_logprobs_on_one_rank_is_token_logprobs():
    one = AxisGroup("tensor", (0,), 0, None)
    logits = torch.randn(2, 5, VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 5))
    padded = torch.cat([logits, torch.zeros(2, 5, 3)], dim=-1)  # entries past the vocabulary ignored
    torch.testing.assert_close(
        vocab_parallel_token_logprobs(padded, tokens, one, VOCAB), token_logprobs(logits, tokens)
    )
    with pytest.raises(ValueError, match="tokens has shape"):
        vocab_parallel_token_logprobs(logits, tokens[:, :4], one, VOCAB)
