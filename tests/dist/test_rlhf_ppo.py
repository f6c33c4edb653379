"""PPO with each model on ranks of its own, in one 4-rank job: the actor with ZeRO-2 over data
ranks 0-1, the critic with 1D tensor parallelism over ranks 2-3, the frozen reference on ranks
0-1 (each computing every row alone). On a fixed experience batch the update takes the same
steps as one process accumulating the same micro-batches (fp32, tolerances from
``tessera.testing.tolerance``); and whole PPO steps (rollouts, experience, update), with the
reference sharded by ZeRO-3 over ranks 0-1 and a reward model split by tp2 over ranks 2-3, give
the single-process metrics and weights.

Rounding differs between the layouts, so only what rounding cannot flip is compared: the clip
fractions (counts past a threshold) are left out (``tests/unit/test_rlhf_losses.py`` checks them
on constructed inputs), and whole steps are compared only where every token the reference
sampled wins its draw by more than the logits' tolerance can move (so both sides sample the same
responses)."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.config import load_config
from tessera.inference.params import SamplingParams
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import (
    Frozen,
    PPOOptions,
    PPOTrainer,
    build_rollout_batch,
    gae,
    load_preferences,
    masked_whiten,
    per_token_rewards,
    response_index,
    sorting_files,
    sorting_reward,
    text_reward,
    to_responses,
    token_logprobs,
    value_model,
)
from tessera.testing import assert_draws_clear, recorded_draws, tolerance, use_layout, within

BYTES = ByteTokenizer()
REWARD = text_reward(sorting_reward, BYTES)
SAMPLE = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=(10,))
OPTIONS = PPOOptions(kl_coef=0.05, epochs=2, minibatches=2)
ROWS = 8
BLOCKS = 2  # build()'s n_layers


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)


def pairs() -> tuple[list[list[int]], list[list[int]]]:
    chosen = load_preferences(sorting_files().train)[:ROWS]
    return [BYTES.encode(p.prompt) for p in chosen], [BYTES.encode(p.chosen) for p in chosen]


def fixed_experience() -> dict[str, torch.Tensor]:
    """An experience batch built by hand from the starting models, the same on every rank."""
    prompts, responses = pairs()
    batch = build_rollout_batch(prompts, responses, pad_id=0)
    index, mask = response_index(batch)
    with torch.no_grad():
        logprobs = to_responses(token_logprobs(build(0)(batch["input_ids"])[:, :-1], batch["labels"]), index)
        values = to_responses(value_model(build(1))(batch["input_ids"])[:, :-1], index)
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand(ROWS, generator=generator)
    ref_logprobs = logprobs + 0.1 * torch.randn(logprobs.shape, generator=generator)
    rewards, kl = per_token_rewards(scores, logprobs, ref_logprobs, mask, 0.05)
    advantages, returns = gae(rewards, values, mask, 1.0, 0.95)
    experience = dict(batch)
    experience.update(
        index=index,
        mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        kl=kl,
        rewards=rewards,
        advantages=masked_whiten(advantages, mask),
        returns=returns,
        scores=scores,
    )
    return experience  # type: ignore[return-value]


def engine(model: torch.nn.Module, ctx, config: dict):
    engine, _, _, _ = tessera.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), ctx=ctx, config=load_config(config)
    )
    return engine


def run(split: bool, whole_step: bool) -> tuple | None:
    """Train the PPO models (split: over the 4-rank job; else in this process alone); returns the
    metrics and both models' full states (from rank 0 and rank 2 when split)."""
    if split:
        actor_config = {"parallel": {"data": 2}, "zero": {"stage": 2}}
        critic_config = {"parallel": {"tensor": 2}, "gradient_accumulation": 2}
        actor_ctx = use_layout(ranks=[0, 1], data=2, config=actor_config)
        critic_ctx = use_layout(ranks=[2, 3], tensor=2, config=critic_config)
    else:
        actor_config = critic_config = {"gradient_accumulation": 2}
        actor_ctx = critic_ctx = use_layout(config=actor_config)
    actor = engine(build(0), actor_ctx, actor_config) if actor_ctx is not None else None
    critic = engine(value_model(build(1)), critic_ctx, critic_config) if critic_ctx is not None else None
    reference = Frozen(build(0)) if actor_ctx is not None else None  # held by the actor's ranks
    reward = REWARD
    if whole_step:  # the reference under ZeRO-3 on ranks 0-1, a reward model under tp2 on ranks 2-3
        if split and actor_ctx is not None:
            zero3 = {"parallel": {"data": 2}, "zero": {"stage": 3}}
            reference = Frozen(engine(build(0), use_layout(ranks=[0, 1], data=2, config=zero3), zero3))
        elif split:
            reference = None
        reward = Frozen(engine(value_model(build(2)), critic_ctx, critic_config)) if critic_ctx is not None else None
    trainer = PPOTrainer(actor, critic, reference, reward, SAMPLE, OPTIONS)
    if whole_step:
        prompts, _ = pairs()
        metrics = [trainer.step(prompts, seed=11), trainer.step(prompts, seed=12)]
    else:
        metrics = [trainer.train(fixed_experience())]
    actor_state = full_state_dict(actor.model) if actor is not None else None
    critic_state = full_state_dict(critic.model) if critic is not None else None
    return metrics, actor_state, critic_state


def assert_same(got, want, steps: int) -> None:
    """The metrics and final states of ``steps`` optimizer steps agree, clip fractions left out."""
    metrics, actor_state, critic_state = got
    want_metrics, want_actor, want_critic = want
    tol = tolerance(blocks=BLOCKS, steps=steps)
    for step, expected in zip(metrics, want_metrics):
        assert step.keys() == expected.keys()
        for key in expected:
            if not key.endswith("clipfrac"):
                assert within(step[key], expected[key], blocks=BLOCKS, steps=steps), (key, step, expected)
    for state, expected in ((actor_state, want_actor), (critic_state, want_critic)):
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], **tol, msg=key)


@pytest.mark.parametrize("whole_step", [False, True], ids=["fixed-experience", "whole-step"])
def test_actor_zero2_dp2_and_critic_tp2_take_the_single_process_steps(pools, whole_step):
    with recorded_draws() as draws:
        expected = run(False, whole_step)
    steps = OPTIONS.epochs * OPTIONS.minibatches * (2 if whole_step else 1)
    if whole_step:  # the same responses: the second rollout follows the first step's update
        assert_draws_clear(draws, blocks=BLOCKS, steps=OPTIONS.epochs * OPTIONS.minibatches)
    results = pools.run(4, run, True, whole_step, timeout=600)
    metrics_0, actor_state, _ = results[0]
    critic_state = results[2][2]
    assert all(r[0] == metrics_0 for r in results)  # every rank reports the same metrics
    assert_same((metrics_0, actor_state, critic_state), expected, steps)
    assert results[1][1] is not None and results[3][2] is not None  # full states on every member
    assert results[0][2] is None and results[2][1] is None  # each model only on its own ranks
    if not whole_step:
        assert expected[0][0]["policy/clipfrac"] > 0  # the second epoch reaches the clip


def run_grpo(split: bool) -> tuple:
    """Two GRPO steps (2 prompts x groups of 4, two optimizer steps each): the actor over the
    4 ranks' data axis with ZeRO-1 and the reference on ranks 2-3 (split), or one process."""
    from tessera.rlhf import GRPOOptions, GRPOTrainer

    config = {"parallel": {"data": 4}, "zero": {"stage": 1}} if split else {"gradient_accumulation": 4}
    ctx = use_layout(data=4, config=config) if split else use_layout(config=config)
    actor = engine(build(0), ctx, config)
    reference = Frozen(build(0)) if not split or ctx.rank >= 2 else None
    options = GRPOOptions(group_size=4, beta=0.04, epochs=1, minibatches=2)
    trainer = GRPOTrainer(actor, reference, REWARD, SAMPLE, options)
    prompts, _ = pairs()
    metrics = [trainer.step(prompts[:4], seed=21), trainer.step(prompts[4:], seed=22)]
    return metrics, full_state_dict(actor.model)


def test_grpo_actor_zero1_dp4_with_the_reference_on_two_ranks_takes_the_single_process_steps(pools):
    with recorded_draws() as draws:
        want_metrics, want_state = run_grpo(False)
    assert_draws_clear(draws, blocks=BLOCKS, steps=2)  # the second rollout follows the first step's 2 steps
    results = pools.run(4, run_grpo, True, timeout=600)
    assert all(r[0] == results[0][0] for r in results)
    assert_same((results[0][0], results[0][1], {}), (want_metrics, want_state, {}), 4)
