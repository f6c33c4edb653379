"""Rollouts from the live training model with the paged KV cache: the same tokens, finish reasons
and log-probabilities as the reference that runs the whole sequence through the model for every
token (greedy and seeded sampling, stop tokens, prompts of many lengths, the model's length);
the model's modes and parameters untouched; new weights seen by the next call; seeds per call,
request and data rank; clear refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.errors import ConfigError
from tessera.inference.params import SamplingParams
from tessera.models.gpt import gpt
from tessera.rlhf.rollout import (
    RolloutGenerator,
    generate_without_cache,
    request_params,
    rollout_batch,
    rollout_seeds,
)
from tessera.testing import assert_draws_clear, recorded_draws, tolerance

VOCAB, MAX_LEN = 32, 48
LENGTHS = (1, 5, 9, 3, 12, 40)  # the last leaves 8 tokens before the model's length
NEW = 20


def tiny_gpt(**fields):
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=VOCAB, max_seq_len=MAX_LEN, d_model=32, n_layers=2, n_heads=4, **fields)


def prompts_of(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompts, params, **options):
    """``generate_without_cache``, each of whose tokens wins by more than the logits' rounding
    (2 blocks) could move: the cached run, which rounds otherwise, has to choose the same."""
    with recorded_draws() as draws:
        rollouts = generate_without_cache(model, prompts, params, **options)
    assert_draws_clear(draws, blocks=2)
    return rollouts


def assert_same(cached, reference):
    assert [(r.prompt, r.response, r.finish_reason) for r in cached] == [
        (r.prompt, r.response, r.finish_reason) for r in reference
    ]
    for a, b in zip(cached, reference):
        assert len(a.logprobs) == len(a.response)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), **tolerance(blocks=2))


def test_greedy_rollouts_are_the_tokens_of_the_full_forward_per_token():
    model = tiny_gpt(dropout=0.1).train()  # dropout would make the two differ: off while generating
    prompts = prompts_of()
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0)
    plain = generate_without_cache(model, prompts, greedy)
    # stop on a token that some responses reach after a few tokens and others never do
    stop = next(r.response[k] for r in plain for k in range(2, 8) if r.response[k] not in r.response[:k])
    params = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=(stop, VOCAB - 1))
    cached = RolloutGenerator(model, params, max_batch=4).generate(prompts)  # 6 prompts: some wait for a slot
    assert_same(cached, reference(model, prompts, params))
    reasons = {r.finish_reason for r in cached}
    assert reasons == {"stop", "length"}
    for r in cached:
        if r.finish_reason == "stop":  # the stop token is given back, and ends the response
            assert r.response[-1] == stop and stop not in r.response[:-1] and len(r.response) <= NEW
        else:
            assert len(r.response) == min(NEW, MAX_LEN - len(r.prompt))
    assert len(cached[-1].response) == MAX_LEN - 40  # the model's length
    batch = rollout_batch(cached, pad_id=0)  # ready for the training forward
    assert batch["input_ids"].shape == (len(prompts), max(len(r.prompt) + len(r.response) for r in cached))
    assert int(batch["response_mask"].sum()) == sum(len(r.response) for r in cached)


def test_seeded_sampling_is_the_reference_and_reproducible():
    model = tiny_gpt()
    prompts = prompts_of((4, 7, 2)) * 2  # each prompt twice: a GRPO group of 2
    params = SamplingParams(max_tokens=12, temperature=1.3, top_k=20, top_p=0.95, stop_token_ids=(3,))
    generator = RolloutGenerator(model, params)
    first = generator.generate(prompts, seed=5)
    assert_same(first, reference(model, prompts, params, seed=5))
    assert [r.response for r in generator.generate(prompts, seed=5)] == [r.response for r in first]
    assert [r.response for r in first[:3]] != [r.response for r in first[3:]]  # each request its own seed
    assert [r.response for r in generator.generate(prompts, seed=6)] != [r.response for r in first]
    other_rank = RolloutGenerator(model, params, stream=1).generate(prompts, seed=5)
    assert [r.response for r in other_rank] != [r.response for r in first]
    # without a seed, each call draws a fresh one; params.seed is the base when the call gives none
    assert [r.response for r in generator.generate(prompts)] != [r.response for r in generator.generate(prompts)]
    based = RolloutGenerator(model, dataclasses.replace(params, seed=5))
    assert [r.response for r in based.generate(prompts)] == [r.response for r in first]


def test_request_seeds_differ_by_request_call_and_stream():
    seeds = rollout_seeds(5, 0, 4)
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert rollout_seeds(5, 0, 6)[:4] == seeds  # a request's seed does not depend on the batch size
    assert set(seeds).isdisjoint(rollout_seeds(5, 1, 4)) and set(seeds).isdisjoint(rollout_seeds(6, 0, 4))
    assert [p.seed for p in request_params(SamplingParams(temperature=1.0), 4, seed=5)] == seeds
    greedy = SamplingParams(temperature=0.0)
    assert request_params(greedy, 2, seed=5) == [greedy, greedy]
    with pytest.raises(ValueError, match="stop on stop_token_ids only"):
        request_params(SamplingParams(stop=("\n",)), 2)


def test_the_model_is_left_as_it_was_and_trains_after():
    model = tiny_gpt(dropout=0.1).train()
    model.blocks[1].eval()  # a mixed state comes back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    RolloutGenerator(model, SamplingParams(max_tokens=6, temperature=1.0)).generate(prompts_of(), seed=1)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    model(torch.tensor(prompts_of((8, 8)))).sum().backward()  # nothing from inference mode stays in the model
    assert all(p.grad is not None for p in model.parameters())


def test_new_weights_are_used_by_the_next_call():
    model = tiny_gpt()
    prompts = prompts_of()
    generator = RolloutGenerator(model, SamplingParams(max_tokens=8, temperature=0.0))
    before = generator.generate(prompts)
    with torch.no_grad():  # what an optimizer step does: in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = generator.generate(prompts)
    assert [r.response for r in after] != [r.response for r in before]
    assert_same(after, reference(model, prompts, generator.params))


def test_a_fixed_cache_runs_the_requests_a_few_at_a_time():
    model = tiny_gpt()
    prompts = prompts_of((10, 10, 10))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    generator = RolloutGenerator(model, params, block_size=4, num_blocks=4)  # 16 slots: one request at a time
    assert generator.cache_for(prompts, [params] * 3).num_blocks == 4
    assert_same(generator.generate(prompts), reference(model, prompts, params))
    assert RolloutGenerator(model, params, block_size=4).cache_for(prompts, [params] * 3).num_blocks == 12
    with pytest.raises(ValueError, match="prompt 1: .*needs 5 KV blocks; the cache has 4"):
        generator.generate([[1], [2] * 14])
    with pytest.raises(ValueError, match="prompt 0: the prompt has 48 tokens; the model holds 48"):
        generator.generate([[1] * MAX_LEN])
    assert generator.generate([]) == []


def test_hf_causal_lm_rollouts_and_its_attention_back():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=50, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=MAX_LEN, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    attention = model.config._attn_implementation
    prompts = prompts_of()
    params = SamplingParams(max_tokens=NEW, temperature=1.0, stop_token_ids=(3,))
    cached = RolloutGenerator(model, params).generate(prompts, seed=2)
    assert_same(cached, reference(model, prompts, params, seed=2))
    assert model.config._attn_implementation == attention and model.training
    ids = torch.tensor(prompts_of((6, 6)))
    model(input_ids=ids, labels=ids).loss.backward()  # trains as before


def test_models_not_whole_on_this_rank_are_refused():
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ConfigError, match="with its GPT and with transformers causal LMs; got Linear"):
        RolloutGenerator(torch.nn.Linear(2, 2), params)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        RolloutGenerator(tiny_gpt(num_experts=4), params)
    with torch.device("meta"):
        meta = tiny_gpt()
    with pytest.raises(ConfigError, match="parameter tok_emb.weight is not whole on this rank .*meta device"):
        RolloutGenerator(meta, params)
