"""Rollouts on each data-parallel rank of a running 2-rank job, alone: no collective during
generation (the ranks take different numbers of steps), the reference's tokens on every rank,
different samples on each rank for the same prompts and seed, and the weights of the optimizer
step just taken (DDP and ZeRO-2). Replicas holding pieces of the model (ZeRO-3, tensor
parallelism) are refused."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.comm import ledger
from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.inference.params import SamplingParams
from tessera.inference.text import ByteTokenizer
from tessera.models import NextTokenLoss, gpt
from tessera.rlhf import sorting_examples
from tessera.rlhf.rollout import RolloutGenerator, generate_without_cache, rollout_batch
from tessera.testing import use_layout

PARAMS = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=(10,))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=48, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def prompts(count: int, seed: int) -> list[list[int]]:
    tokenizer = ByteTokenizer()
    return [tokenizer.encode(e.prompt) for e in sorting_examples(count, seed=seed)]


def responses(rollouts) -> list[list[int]]:
    return [r.response for r in rollouts]


def rollouts_and_a_step(zero: int) -> dict:
    ctx = use_layout(data=2, config={"parallel": {"data": 2}, "zero": {"stage": zero}})
    model = build()
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), NextTokenLoss())
    rank = ctx.local_rank("data")
    generator = RolloutGenerator(engine.model, PARAMS, ctx=ctx)  # a DDP wrapper's module
    mine = prompts(3 + 2 * rank, seed=rank)  # each rank its own prompts, as many as it has
    with ledger() as led:
        before = generator.generate(mine, seed=1)
        if rank == 0:  # a call the other rank does not make
            generator.generate(mine[:1], seed=9)
    same_before = responses(before) == responses(generate_without_cache(model, mine, PARAMS, seed=1, stream=rank))
    shared = generator.generate(prompts(4, seed=7), seed=2)
    batch = rollout_batch(before, pad_id=0)
    engine.train()
    engine.train_batch(iter([(batch["input_ids"][:, :-1], batch["labels"])]))
    after = generator.generate(mine, seed=1)
    return {
        "calls": led.calls(),
        "stream": generator.stream,
        "before": same_before,
        "after": responses(after) == responses(generate_without_cache(model, mine, PARAMS, seed=1, stream=rank)),
        "changed": [r.logprobs for r in after] != [r.logprobs for r in before],  # the new weights
        "shared": responses(shared),
    }


@pytest.mark.parametrize("zero", [0, 2])
def test_each_rank_generates_alone_from_the_current_weights(pools, zero):
    results = pools.run(2, rollouts_and_a_step, zero)
    for rank, result in enumerate(results):
        assert result["calls"] == 0, f"rank {rank} communicated while generating"
        assert result["stream"] == rank
        assert result["before"] and result["after"] and result["changed"], (rank, result)
    assert results[0]["shared"] != results[1]["shared"]  # same prompts, same seed: other samples per rank


def refusals(layout: str) -> list[str]:
    if layout == "zero3 dp2":
        use_layout(data=2, config={"parallel": {"data": 2}, "zero": {"stage": 3}})
    else:
        use_layout(tensor=2, data=1, config={"parallel": {"tensor": 2, "data": 1}})
    model = build()
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), NextTokenLoss())
    messages = []
    for ctx in (None, ParallelContext.alone()):  # the current context's layout, then the parameters alone
        with pytest.raises(ConfigError) as error:
            RolloutGenerator(engine.model, PARAMS, ctx=ctx)
        messages.append(str(error.value))
    return messages


def test_replicas_that_do_not_hold_the_whole_model_are_refused(pools):
    for messages in pools.run(2, refusals, "zero3 dp2"):
        assert all(
            "parameter tok_emb.weight is not whole on this rank (it is a ZeRO-3/Gemini piece)" in m for m in messages
        )
    for current, alone in pools.run(2, refusals, "tp2"):
        assert "needs the whole model and sequence on one rank; this layout splits them (tensor=2)" in current
        assert "parameter tok_emb.weight is not whole on this rank (it is split along tensor)" in alone
