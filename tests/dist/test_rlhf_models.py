"""Value models and token log-probs on 2 ranks against one process (fp32, tolerances from
``tessera.testing.tolerance``).

A reward model (a value model on a tiny tessera GPT; on a tiny Hugging Face GPT-2, split by its
policy when the value model is built) trains a few SGD steps on preference pairs with the
pairwise loss through ``tessera.initialize``, under 1D tensor parallelism (with and without
sequence-parallel regions) and data parallelism: the same losses, final weights (the replicated
head among them) and values as single-process training. The token log-probs of a GPT whose
logits are split over an uneven vocabulary, and one SGD step on them, equal the plain ones."""

from __future__ import annotations

import pytest
import torch
import transformers

import tessera
from tessera.checkpoint import full_state_dict
from tessera.context.placement import placement_of
from tessera.errors import TesseraError
from tessera.hf.apply import prepare
from tessera.models import gpt
from tessera.rlhf import pairwise_reward_loss, token_logprobs
from tessera.rlhf.models import sequence_values, token_logprobs_fn, value_model
from tessera.testing import tolerance, use_layout

STEPS, PAIRS, SEQ, VOCAB, D = 3, 4, 8, 67, 32  # the vocabulary does not divide 2


def tiny_gpt():
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=VOCAB, max_seq_len=SEQ, d_model=D, n_layers=2, n_heads=4)


def tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def build(family: str):
    """A reward model with the same weights on every rank and in the reference."""
    if family == "gpt":
        return value_model(tiny_gpt(), head_seed=1)
    return value_model(tiny_gpt2(), head_seed=1)  # its base model split here under tp


def pairs(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s pairs, right-padded: ``input_ids [2P, T]`` (the chosen rows, then the
    rejected ones), ``attention_mask`` and each row's ``last_index``."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, VOCAB, (2 * PAIRS, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (2 * PAIRS,), generator=g)
    mask = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.where(mask, tokens, torch.zeros_like(tokens)), mask.long(), lengths - 1


def mine(batch: tuple[torch.Tensor, ...], part: int, parts: int) -> tuple[torch.Tensor, ...]:
    """A data rank's pairs: its chosen rows, then the rejected rows of the same pairs."""
    per = PAIRS // parts
    chosen = torch.arange(part * per, (part + 1) * per)
    rows = torch.cat([chosen, chosen + PAIRS])
    return tuple(t[rows] for t in batch)


def train(family: str, layout: dict) -> tuple:
    """Train a reward model on this rank of ``layout`` (``{}``: one process)."""
    data, tensor = layout.get("data", 1), layout.get("tensor", 1)
    sp, mode = layout.get("sequence_parallel", False), layout.get("mode", "1d")
    config = {"parallel": {"data": data, "tensor": {"size": tensor, "mode": mode, "sequence_parallel": sp}}}
    ctx = use_layout(**layout, config=config)
    model = build(family)
    split = any(placement_of(p).shard is not None for p in model.parameters())
    # SGD: its step is linear in the gradient, so the reduction order's last bits stay last bits
    # (AdamW's normalisation lifts them to 1e-4 relative on a near-zero gradient; in float64 every
    # layout here equals one process to 1e-15)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = tessera.initialize(model, optimizer)
    losses, accuracies = [], []
    for step in range(STEPS):
        input_ids, mask, last = mine(pairs(step), ctx.local_rank("data"), data)
        engine.zero_grad()
        chosen, rejected = sequence_values(engine(input_ids, attention_mask=mask), last).chunk(2)
        loss, accuracy = pairwise_reward_loss(chosen, rejected)
        engine.backward(loss)
        engine.step()
        losses.append(engine.mean_over_data(loss))
        # with each pair's reward gap and the larger reward's size, for the margin check
        gap, size = (chosen - rejected).detach(), torch.maximum(chosen.abs(), rejected.abs()).detach()
        accuracies.append((engine.mean_over_data(accuracy), gap, size))
    input_ids, mask, _ = pairs(STEPS)
    with torch.no_grad():
        values = engine.module(input_ids, attention_mask=mask)  # the whole batch on every rank
    return losses, accuracies, full_state_dict(engine), values, split


LAYOUTS = {
    "gpt-tp2": ("gpt", dict(tensor=2)),
    "gpt-tp2-sequence-parallel": ("gpt", dict(tensor=2, sequence_parallel=True)),
    "gpt-dp2": ("gpt", dict(data=2)),
    "gpt2-hf-tp2": ("gpt2", dict(tensor=2)),
    "gpt-2d": ("gpt", dict(tensor=4, mode="2d")),  # hidden states gathered over batch and hidden blocks
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_reward_model_trains_as_in_one_process(pools, name):
    family, layout = LAYOUTS[name]
    ref_losses, ref_accuracies, ref_state, ref_values, _ = train(family, {})
    results = pools.run(layout.get("tensor", 1) * layout.get("data", 1), train, family, layout, timeout=300)
    tol = tolerance(blocks=2, steps=STEPS)
    # an accuracy counts the pairs with chosen > rejected, which one rounding can flip: it is
    # compared across layouts because every pair of the reference is farther apart than twice the
    # rewards' tolerance
    for _, gap, size in ref_accuracies:
        assert (gap.abs() > 2 * (tol["atol"] + tol["rtol"] * size)).all(), ("a pair too close to call", gap)
    for losses, accuracies, state, values, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
        assert [a[0] for a in accuracies] == [a[0] for a in ref_accuracies]
        assert set(state) == set(ref_state) and {"score.weight", "score.bias"} <= set(state)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, **tol, msg=lambda m, key=key: key + m)
        torch.testing.assert_close(values, ref_values, **tol)
    assert not torch.equal(ref_state["score.weight"], build(family).score.weight), "the head trained"
    assert len(set(ref_losses)) == STEPS  # the steps moved the loss
    assert all(r[4] == (layout.get("tensor", 1) > 1) for r in results), "the backbone split over the tensor axis"


def logprobs_step(layout: dict) -> tuple:
    """Token log-probs of a GPT on this rank of ``layout`` and its weights after one SGD step on
    their negated mean."""
    use_layout(**layout)
    model = tiny_gpt()
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))
    logprobs = token_logprobs_fn(model)
    logits = model(tokens)
    per_token = logprobs(logits[:, :-1], tokens[:, 1:])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    (-per_token.mean()).backward()
    optimizer.step()
    return per_token.detach(), full_state_dict(model), logits.shape[-1], logprobs is token_logprobs


def test_token_logprobs_of_vocabulary_split_logits_equal_one_process(pools):
    expected, expected_state, full_vocab, plain = logprobs_step({})
    assert full_vocab == VOCAB and plain
    for per_token, state, local_vocab, plain in pools.run(2, logprobs_step, dict(tensor=2), timeout=120):
        assert local_vocab == (VOCAB + 1) // 2 and not plain  # a block of the vocabulary: the parallel path
        torch.testing.assert_close(per_token, expected, **tolerance(blocks=2))
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, **tolerance(blocks=2, steps=1), msg=lambda m, key=key: key + m)


def refused(kind: str) -> str:
    if kind == "pipeline":
        use_layout(pipeline=2)
        model = tiny_gpt2()
    else:  # a model split by tessera already (its causal LM through its policy)
        model = prepare(tiny_gpt2(), None, use_layout(tensor=2))
    try:
        value_model(model)
    except TesseraError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_transformers_value_model_refuses_pipeline_stages_and_a_split_model(pools):
    pipeline, split = pools.run(2, refused, "pipeline")[0], pools.run(2, refused, "split")[0]
    assert pipeline.startswith("NotAvailableError") and "parallel.pipeline.size=2" in pipeline
    assert "GPT2Model" in pipeline and "data, tensor or sequence parallelism" in pipeline
    assert split.startswith("ConfigError") and "GPT2Model is split for tensor parallelism already" in split
