"""tessera.rlhf.losses: every loss and advantage against numbers worked out by hand from its
formula (plain Python floats, ``math.exp``/``math.log``), padding that changes nothing, gradients
that reach only what they should, and clear errors for bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera.rlhf import (
    AdaptiveKLController,
    FixedKLController,
    dpo_loss,
    gae,
    grpo_advantages,
    grpo_loss,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    pairwise_reward_loss,
    per_token_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    sft_loss,
    token_logprobs,
)
from tessera.rlhf import tokens as tokens_module

HUGE = 1.0e4  # what padded slots hold in the masking tests: large enough that exp() overflows


def close(actual: torch.Tensor | float, expected: float | list, **tolerance) -> None:
    """assert_close against a number or nested list written out by hand (float32 tolerances)."""
    actual = actual if isinstance(actual, torch.Tensor) else torch.tensor(actual)
    expected_tensor = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_tensor, **tolerance)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def padded(x: torch.Tensor, mask: torch.Tensor, value: float = HUGE) -> torch.Tensor:
    """``x`` with ``value`` written into the slots where ``mask`` is false."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


# --- token_logprobs, sft_loss ---------------------------------------------------------------


def test_token_logprobs_is_the_log_softmax_at_each_token():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], [[2.0, -1.0, 0.5], [10.0, 0.0, -10.0]]])
    tokens = torch.tensor([[2, 1], [0, 2]])
    z1 = math.log(math.e + math.e**2 + math.e**3)
    z3 = math.log(math.exp(2.0) + math.exp(-1.0) + math.exp(0.5))
    z4 = math.log(math.exp(10.0) + 1.0 + math.exp(-10.0))
    expected = [[3.0 - z1, -math.log(3.0)], [2.0 - z3, -10.0 - z4]]
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32 and out.shape == (2, 2)
    close(out, expected)


def test_token_logprobs_of_bf16_logits_is_float32_math_on_the_bf16_values():
    logits = (torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, tokens)
    reference = torch.log_softmax(logits.double(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_elements", [7, 30, 1 << 24])
def test_token_logprobs_gradient_matches_log_softmax_in_any_blocks(monkeypatch, block_elements):
    # 7 logits per block: one position at a time; 30: two whole rows of 3 x 5 logits at a time
    monkeypatch.setattr(tokens_module, "_LOGITS_CHUNK_ELEMENTS", block_elements)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=generator)
    weights = torch.randn(2, 3, generator=generator, dtype=torch.float64)
    (token_logprobs(logits, tokens) * weights).sum().backward()
    reference = logits.detach().clone().requires_grad_(True)
    (torch.log_softmax(reference, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * weights).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens), (logits.detach().requires_grad_(True),))


def test_token_logprobs_bf16_gradient_comes_back_in_bf16():
    logits = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(4))
    token_logprobs(logits, tokens).sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    expected = F.one_hot(tokens, 16).float() - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(logits.grad.float(), expected, rtol=0, atol=1e-2)


def test_token_logprobs_rejects_bad_shapes_and_ids():
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\]"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens has shape"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 4\).*-100"):
        token_logprobs(logits, torch.tensor([[0, 1, -100], [0, 0, 0]]))
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, torch.zeros(2, 3))


def test_sft_loss_averages_over_response_tokens_only():
    # two sequences; logits over a 3-token vocabulary; the first position of each is prompt
    logits = torch.tensor(
        [
            [[5.0, 1.0, 1.0], [1.0, 2.0, 0.0], [0.0, 0.0, 3.0]],
            [[9.0, -9.0, 0.0], [0.5, 0.5, 0.0], [1.0, 1.0, 1.0]],
        ]
    )
    labels = torch.tensor([[-100, 1, 2], [-100, 0, 1]])
    loss_mask = torch.tensor([[0, 1, 1], [0, 1, 0]])  # the last slot of row 2 is padding
    nll_a = -(2.0 - math.log(math.e + math.e**2 + 1.0))
    nll_b = -(3.0 - math.log(2.0 + math.e**3))
    nll_c = -(0.5 - math.log(2.0 * math.exp(0.5) + 1.0))
    expected = (nll_a + nll_b + nll_c) / 3
    loss = sft_loss(logits, labels, loss_mask)
    close(loss, expected)
    # prompt and padding slots change nothing, whatever their logits and labels
    changed = logits.clone()
    changed[:, 0] = HUGE
    changed[1, 2] = -HUGE
    close(sft_loss(changed, torch.tensor([[7, 1, 2], [2, 0, 0]]), loss_mask), expected)
    # Hugging Face's labels with -100 at ignored tokens compute the same mean
    hf_labels = labels.masked_fill(loss_mask == 0, -100)
    close(loss, F.cross_entropy(logits.flatten(0, 1), hf_labels.flatten(), ignore_index=-100).item())


def test_sft_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="loss_mask has shape"):
        sft_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2))
    with pytest.raises(ValueError, match="labels has shape"):
        sft_loss(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


# --- masked reductions ------------------------------------------------------------------------


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, HUGE], [4.0, HUGE, HUGE]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    close(masked_sum(x, mask), 7.0)
    close(masked_mean(x, mask), 7.0 / 3)
    close(masked_sum(x, mask, dim=1), [3.0, 4.0])
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    close(masked_mean(x, mask.int(), dim=0), [2.5, 2.0, 0.0])  # 0/1 masks work; an empty column gives 0
    inf_x = x.masked_fill(~mask, math.inf)
    close(masked_mean(inf_x, mask), 7.0 / 3)
    with pytest.raises(ValueError, match="mask has shape"):
        masked_mean(x, mask[:, :2])


def test_masked_mean_gives_padded_slots_zero_gradient():
    x = torch.tensor([[1.0, 2.0, math.inf]], requires_grad=True)
    masked_mean(x, torch.tensor([[1, 1, 0]])).backward()
    close(x.grad, [[0.5, 0.5, 0.0]])


def test_masked_whiten_uses_the_unbiased_variance():
    x = torch.tensor([[1.0, 3.0], [5.0, HUGE]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 3, unbiased variance ((1-3)^2 + 0 + (5-3)^2) / (3 - 1) = 4, std 2
    close(masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[2.0, 3.0], [4.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2 real entries"):
        masked_whiten(x, torch.tensor([[1, 0], [0, 0]]))


# --- reward model -----------------------------------------------------------------------------


def test_pairwise_reward_loss_with_and_without_margin():
    chosen = torch.tensor([2.0, 0.5, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.5, -1.0], requires_grad=True)
    loss, accuracy = pairwise_reward_loss(chosen, rejected)
    close(loss, -(log_sigmoid(1.0) + log_sigmoid(-1.0) + log_sigmoid(2.0)) / 3)
    close(accuracy, 2 / 3)
    margin = torch.tensor([0.5, 0.0, 3.0])
    loss, accuracy = pairwise_reward_loss(chosen, rejected, margin)
    close(loss, -(log_sigmoid(0.5) + log_sigmoid(-1.0) + log_sigmoid(-1.0)) / 3)
    close(accuracy, 2 / 3)  # the margin does not change which pairs are ranked right
    loss.backward()
    # d/d chosen_b of -log sigmoid(u_b) / B is -sigmoid(-u_b) / B; rejected gets the opposite
    sig = [1 / (1 + math.exp(u)) for u in (0.5, -1.0, -1.0)]
    close(chosen.grad, [-s / 3 for s in sig])
    close(rejected.grad, [s / 3 for s in sig])
    close(
        pairwise_reward_loss(chosen, rejected, 0.5)[0], -(log_sigmoid(0.5) + log_sigmoid(-1.5) + log_sigmoid(1.5)) / 3
    )


def test_pairwise_reward_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="rejected must be"):
        pairwise_reward_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="margin must be"):
        pairwise_reward_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="chosen must be"):
        pairwise_reward_loss(torch.zeros(3, 1), torch.zeros(3, 1))


# --- PPO: GAE, KL, per-token rewards, controllers ---------------------------------------------


def gae_by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list, list]:
    """The GAE recursion for one row of real tokens, the value after the last one being 0."""
    advantages = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_gae_on_a_two_by_three_batch():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.5, 2.0, HUGE]])
    values = torch.tensor([[0.3, 0.4, 0.5], [1.0, -1.0, HUGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 1 written out: delta_2 = 1.0 - 0.5 = 0.5; delta_1 = -0.2 + 0.9*0.5 - 0.4 = -0.15;
    # delta_0 = 0.1 + 0.9*0.4 - 0.3 = 0.16; A_2 = 0.5; A_1 = -0.15 + 0.72*0.5 = 0.21;
    # A_0 = 0.16 + 0.72*0.21 = 0.3112
    row1 = [0.3112, 0.21, 0.5]
    row2, returns2 = gae_by_hand([0.5, 2.0], [1.0, -1.0], gamma, lam)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    close(advantages, [row1, [*row2, 0.0]])
    close(returns, [[0.3112 + 0.3, 0.21 + 0.4, 0.5 + 0.5], [*returns2, 0.0]])
    assert advantages.dtype == torch.float32 and not advantages.requires_grad
    # gamma = lam = 1 sums the rewards to go minus the value
    advantages, _ = gae(rewards, values, mask, 1.0, 1.0)
    close(advantages[0], [0.9 - 0.3, 0.8 - 0.4, 1.0 - 0.5])


def test_gae_ignores_padded_slots_and_checks_its_input():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0, 0]])
    clean = gae(rewards * mask, values * mask, mask, 0.95, 0.9)
    noisy = gae(padded(rewards, mask), padded(values, mask, -HUGE), mask, 0.95, 0.9)
    for a, b in zip(clean, noisy):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="right-padded"):
        gae(rewards, values, torch.tensor([[1, 0, 1, 0]]), 0.9, 0.9)
    with pytest.raises(ValueError, match="values has shape"):
        gae(rewards, values[:, :3], mask, 0.9, 0.9)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(rewards, values, mask, 1.5, 0.9)


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]  # logprobs - ref
    close(kl_estimate(logprobs, ref, "k1"), d)
    close(kl_estimate(logprobs, ref, "abs"), [0.5, 1.0, 0.0])
    close(kl_estimate(logprobs, ref, "mse"), [0.125, 0.5, 0.0])
    close(kl_estimate(logprobs, ref, "k3"), [math.exp(-x) - 1 + x for x in d])
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(logprobs, ref, "k2")
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        kl_estimate(logprobs, ref[:2])


def test_per_token_rewards_put_the_score_on_the_last_real_token():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, HUGE]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.1, -HUGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([2.0, -7.0])
    rewards, kl = per_token_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    close(kl, [[0.5, -1.0, 0.0], [0.0, -0.2, 0.0]])
    close(rewards, [[-0.05, 0.1, 2.0], [0.0, 0.02 - 7.0, 0.0]])
    rewards, kl = per_token_rewards(scores, logprobs, ref, mask, kl_coef=0.1, kind="k3", clip_score=5.0)
    k3 = [[math.exp(-x) - 1 + x for x in row] for row in ([0.5, -1.0, 0.0], [0.0, -0.2])]
    close(kl, [k3[0], [*k3[1], 0.0]])
    close(rewards, [[-0.1 * k3[0][0], -0.1 * k3[0][1], 2.0], [0.0, -0.1 * k3[1][1] - 5.0, 0.0]])
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        per_token_rewards(scores, logprobs, ref, torch.tensor([[1, 1, 1], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match="scores must be"):
        per_token_rewards(scores[:1], logprobs, ref, mask, 0.1)
    with pytest.raises(ValueError, match="right-padded"):
        per_token_rewards(scores, logprobs, ref, torch.tensor([[0, 1, 1], [1, 1, 0]]), 0.1)


def test_adaptive_kl_controller_follows_ziegler_et_al():
    controller = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5, clipped to 0.2
    close(controller.value, 0.2 * (1 + 0.2 * 256 / 10000))
    controller.update(current_kl=torch.tensor(6.6), n_steps=100)  # error 0.1, not clipped
    expected = 0.2 * (1 + 0.2 * 256 / 10000) * (1 + 0.1 * 100 / 10000)
    close(controller.value, expected)
    controller.update(current_kl=0.0, n_steps=50)  # error -1, clipped to -0.2
    expected *= 1 - 0.2 * 50 / 10000
    close(controller.value, expected)
    resumed = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.value == controller.value
    with pytest.raises(ValueError, match="unknown: \\['coef'\\]"):
        resumed.load_state_dict({"value": 0.1, "coef": 0.1})
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 6.0, 0)


def test_fixed_kl_controller_stays_put():
    controller = FixedKLController(0.05)
    controller.update(100.0, 512)
    assert controller.value == 0.05 and controller.state_dict() == {"value": 0.05}
    controller.load_state_dict({"value": 0.07})
    assert controller.value == 0.07
    with pytest.raises(ValueError, match="must be >= 0"):
        FixedKLController(-0.1)


# --- PPO losses -------------------------------------------------------------------------------


def test_ppo_policy_loss_clips_as_the_surrogate_says():
    eps = 0.2
    ratios = [[1.5, 0.5, 1.1], [1.5, 1.0, 7.0]]
    advantages = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 3.0, HUGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -1.2, HUGE]])
    logprobs = (old + torch.tensor(ratios).log()).requires_grad_(True)
    # per token max(-A r, -A clip(r)):
    # (1.5, A=1): max(-1.5, -1.2) = -1.2 clipped;  (0.5, A=-1): max(0.5, 0.8) = 0.8 clipped
    # (1.1, A=2): -2.2 both, not clipped;          (1.5, A=-1): max(1.5, 1.2) = 1.5 not clipped
    # (1.0, A=3): -3.0
    loss, stats = ppo_policy_loss(logprobs, old, advantages, mask, clip_eps=eps)
    close(loss, (-1.2 + 0.8 - 2.2 + 1.5 - 3.0) / 5)
    close(stats["clipfrac"], 2 / 5)
    log_ratios = [math.log(r) for r in (1.5, 0.5, 1.1, 1.5, 1.0)]
    close(stats["approx_kl"], 0.5 * sum(x * x for x in log_ratios) / 5)
    close(stats["ratio_mean"], (1.5 + 0.5 + 1.1 + 1.5 + 1.0) / 5)
    loss.backward()
    # d/dlogp of -A r is -A r where the unclipped term wins, 0 where the clipped one does
    close(logprobs.grad, [[0.0, 0.0, -2.2 / 5], [1.5 / 5, -3.0 / 5, 0.0]])


def test_ppo_policy_loss_padding_and_gradient_targets():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    generator = torch.Generator().manual_seed(5)
    logprobs = -torch.rand(2, 4, generator=generator)
    old = logprobs + 0.3 * torch.randn(2, 4, generator=generator)
    advantages = torch.randn(2, 4, generator=generator)
    policy = logprobs.clone().requires_grad_(True)
    old_leaf, adv_leaf = old.clone().requires_grad_(True), advantages.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(policy, old_leaf, adv_leaf, mask)
    loss.backward()
    assert old_leaf.grad is None and adv_leaf.grad is None  # targets are detached
    noisy = padded(logprobs, mask).requires_grad_(True)
    noisy_loss, _ = ppo_policy_loss(noisy, padded(old, mask, -HUGE), padded(advantages, mask), mask)
    noisy_loss.backward()
    torch.testing.assert_close(noisy_loss, loss)
    assert noisy.grad is not None and policy.grad is not None
    torch.testing.assert_close(noisy.grad, policy.grad)
    assert noisy.grad[0, 2:].eq(0).all()


def test_ppo_value_loss_clips_around_the_old_values():
    values = torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.0, HUGE]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.1, 1.0], [0.5, 0.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 1.0, 3.0], [1.5, 0.0, -HUGE]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # clipped values (clip 0.2 around old): 0.7, 0.0, 1.2, 0.5, 0.0
    # unclipped sq err: 1.0, 1.0, 1.0, 1.0, 0.0; clipped sq err: 0.49, 1.0, 3.24, 1.0, 0.0
    # max: 1.0, 1.0, 3.24, 1.0, 0.0 -> the third token is clipped (3.24 > 1.0)
    loss, stats = ppo_value_loss(values, old_values, returns, mask, clip_value=0.2)
    close(loss, 0.5 * (1.0 + 1.0 + 3.24 + 1.0 + 0.0) / 5)
    close(stats["clipfrac"], 1 / 5)
    loss.backward()
    # d/dv of 0.5 (v - R)^2 / 5 is (v - R) / 5 where the unclipped error wins, and also where the
    # two tie inside the clip range (both move with v); 0 where the clipped error wins (the clipped
    # value stands still outside the clip range)
    close(values.grad, [[1.0 / 5, -1.0 / 5, 0.0], [-1.0 / 5, 0.0, 0.0]])
    assert old_values.grad is None and returns.grad is None
    loss, stats = ppo_value_loss(values, old_values, returns, mask, clip_value=None)
    close(loss, 0.5 * (1.0 + 1.0 + 1.0 + 1.0 + 0.0) / 5)
    close(stats["clipfrac"], 0.0)
    with pytest.raises(ValueError, match="clip_value must be > 0 or None"):
        ppo_value_loss(values, old_values, returns, mask, clip_value=0.0)
    with pytest.raises(ValueError, match="returns has shape"):
        ppo_value_loss(values, old_values, returns[:, :2], mask)


def test_ppo_value_clipfrac_counts_only_tokens_the_clip_moved():
    """Inside the clip range ``old + (v - old)`` is ``v`` only up to rounding (``v`` near 0 and
    ``old`` farther out: ``v - old`` rounds at ``old``'s scale): with the returns at the values, that
    rounding makes the "clipped" error the larger wherever it is not exact (TRL's count), yet no
    clip took effect; a value moved past the clip range away from its return is counted."""
    g = torch.Generator().manual_seed(0)
    values = torch.rand(4, 16, generator=g) * 0.01
    old_values = values + 0.1 + 0.05 * torch.rand(4, 16, generator=g)  # within the clip of 0.2
    mask = torch.ones(4, 16, dtype=torch.long)
    assert (old_values + (values - old_values) != values).float().mean() > 0.5  # the rounding this is about
    _, stats = ppo_value_loss(values, old_values, values, mask, clip_value=0.2)
    close(stats["clipfrac"], 0.0)
    moved = values.clone()
    moved[0, 0] = old_values[0, 0] + 0.5  # past the clip, the return at the old value: clipped error 0.04 < 0.25
    moved[0, 1] = old_values[0, 1] + 0.5  # past the clip, the return beyond: clipped error the larger
    returns = values.clone()
    returns[0, 0], returns[0, 1] = old_values[0, 0], old_values[0, 1] + 2.0
    _, stats = ppo_value_loss(moved, old_values, returns, mask, clip_value=0.2)
    close(stats["clipfrac"], 1 / 64)


# --- DPO --------------------------------------------------------------------------------------


def test_dpo_sigmoid_loss_and_rewards_by_hand():
    policy_chosen = torch.tensor([-10.0, -8.0], requires_grad=True)
    policy_rejected = torch.tensor([-12.0, -7.0], requires_grad=True)
    ref_chosen = torch.tensor([-11.0, -8.5], requires_grad=True)
    ref_rejected = torch.tensor([-11.5, -7.5], requires_grad=True)
    beta = 0.1
    # h = (pc - rc) - (pr - rr): row 1: 1.0 - (-0.5) = 1.5; row 2: 0.5 - 0.5 = 0.0
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    close(losses, [-log_sigmoid(0.15), math.log(2.0)])
    close(chosen_rewards, [0.1, 0.05])
    close(rejected_rewards, [-0.05, 0.05])
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad
    losses.sum().backward()
    # d/d pc of -log sigmoid(beta h) is -beta sigmoid(-beta h); pr gets the opposite sign
    slope = [beta / (1 + math.exp(0.15)), beta / 2]
    close(policy_chosen.grad, [-s for s in slope])
    close(policy_rejected.grad, slope)
    assert ref_chosen.grad is None and ref_rejected.grad is None
    # cDPO: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing=0.1)
    close(losses, [-0.9 * log_sigmoid(0.15) - 0.1 * log_sigmoid(-0.15), math.log(2.0)])


def test_dpo_hinge_ipo_and_reference_free_by_hand():
    pc, pr = torch.tensor([-10.0, -8.0]), torch.tensor([-12.0, -7.0])
    rc, rr = torch.tensor([-11.0, -8.5]), torch.tensor([-11.5, -7.5])
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")
    close(losses, [0.25, 1.0])  # relu(1 - 0.5 * 1.5), relu(1 - 0)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    close(losses, [(1.5 - 1.0) ** 2, (0.0 - 1.0) ** 2])  # (h - 1 / (2 beta))^2
    # reference-free: h = pc - pr = 2.0 and -1.0; the rewards are beta * policy log-probs
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, None, None, beta=0.1, reference_free=True)
    close(losses, [-log_sigmoid(0.2), -log_sigmoid(-0.1)])
    close(chosen_rewards, [-1.0, -0.8])
    close(rejected_rewards, [-1.2, -0.7])


def test_dpo_loss_rejects_bad_options():
    pc = pr = rc = rr = torch.zeros(3)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")
    with pytest.raises(ValueError, match="reference log-probs are None"):
        dpo_loss(pc, pr, None, None)
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type='sigmoid' only"):
        dpo_loss(pc, pr, rc, rr, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 0.5\)"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="ref_rejected_logps must be"):
        dpo_loss(pc, pr, rc, torch.zeros(2))


# --- GRPO -------------------------------------------------------------------------------------


def test_grpo_advantages_use_the_unbiased_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 0.0, 1.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: all equal -> 0;
    # group 3: mean 1, deviations -1, 2, -1, 0, unbiased std sqrt(6 / 3)
    std1, std3 = math.sqrt(1 / 3), math.sqrt(2.0)
    expected = [0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), 0.5 / (std1 + 1e-4)]
    expected += [0.0] * 4 + [d / (std3 + 1e-4) for d in (-1.0, 2.0, -1.0, 0.0)]
    close(grpo_advantages(rewards, group_size=4), expected)
    close(grpo_advantages(rewards, group_size=4, scale=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -1.0, 2.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        grpo_advantages(rewards, group_size=5)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo_advantages(rewards, group_size=1)


def grpo_token_loss(ratio: float, advantage: float, eps: float, beta: float, d: float) -> float:
    """One token of GRPO's loss by hand: d = ref - logp."""
    clipped = min(max(ratio, 1 - eps), 1 + eps)
    return -min(ratio * advantage, clipped * advantage) + beta * (math.exp(d) - d - 1)


def test_grpo_loss_aggregations_by_hand():
    eps, beta = 0.2, 0.04
    ratios = [[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]]
    d = [[0.1, -0.2, 0.0], [0.3, 0.05, 0.0]]  # ref - logp
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.8, -1.6, HUGE]])
    logprobs = old + torch.tensor(ratios).log()
    ref = logprobs + torch.tensor(d)
    token = [
        [grpo_token_loss(ratios[b][t], float(advantages[b]), eps, beta, d[b][t]) for t in range(3)] for b in range(2)
    ]
    row_means = [sum(token[0]) / 3, sum(token[1][:2]) / 2]
    expected = {
        "grpo": sum(row_means) / 2,
        "bnpo": (sum(token[0]) + sum(token[1][:2])) / 5,
        "dr_grpo": (sum(token[0]) + sum(token[1][:2])) / (2 * 3),
    }
    for loss_type, value in expected.items():
        loss, stats = grpo_loss(logprobs, old, ref, advantages, mask, eps, beta, loss_type)
        close(loss, value)
        # clipped: (1.5, A=+1) above 1 + eps; (0.5, A=-2) below 1 - eps
        close(stats["clipfrac"], 2 / 5)
        close(stats["kl"], sum(math.exp(x) - x - 1 for x in (0.1, -0.2, 0.0, 0.3, 0.05)) / 5)
    assert min(abs(expected["grpo"] - expected["bnpo"]), abs(expected["bnpo"] - expected["dr_grpo"])) > 1e-3


def test_grpo_loss_without_old_or_reference_log_probs():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    advantages = torch.tensor([0.5, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = grpo_loss(logprobs, None, None, advantages, mask, beta=0.0)
    # ratio 1 everywhere: the loss is -mean(A) over sequences, the gradient -A / (B * n_b) per token
    close(loss, -(0.5 - 1.0) / 2)
    assert "kl" not in stats
    loss.backward()
    close(logprobs.grad, [[-0.5 / 4, -0.5 / 4], [1.0 / 2, 0.0]])
    with pytest.raises(ValueError, match="ref_logprobs is None but beta=0.04"):
        grpo_loss(logprobs, None, None, advantages, mask)


def test_grpo_loss_padding_and_gradient_targets():
    generator = torch.Generator().manual_seed(6)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    logprobs = -torch.rand(3, 4, generator=generator)
    old = logprobs + 0.3 * torch.randn(3, 4, generator=generator)
    ref = logprobs + 0.3 * torch.randn(3, 4, generator=generator)
    advantages = torch.randn(3, generator=generator)
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        policy = logprobs.clone().requires_grad_(True)
        targets = [t.clone().requires_grad_(True) for t in (old, ref, advantages)]
        loss, _ = grpo_loss(policy, *targets[:2], targets[2], mask, loss_type=loss_type)
        loss.backward()
        assert all(t.grad is None for t in targets)
        noisy = padded(logprobs, mask, -HUGE).requires_grad_(True)
        noisy_loss, _ = grpo_loss(noisy, padded(old, mask), padded(ref, mask), advantages, mask, loss_type=loss_type)
        noisy_loss.backward()
        torch.testing.assert_close(noisy_loss, loss)
        assert noisy.grad is not None and policy.grad is not None
        torch.testing.assert_close(noisy.grad, policy.grad)


def test_grpo_loss_rejects_bad_options():
    x, mask, advantages = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_loss(x, x, x, advantages, mask, loss_type="dapo")
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(x, x, x, torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        grpo_loss(x, torch.zeros(2, 2), x, advantages, mask)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        grpo_loss(x, x, x, advantages, mask, clip_eps=0.0)


# --- dtypes -----------------------------------------------------------------------------------


def test_bf16_inputs_give_float32_losses():
    mask = torch.ones(2, 3)
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -1.5, -0.75]])
    old = logprobs + 0.125
    half = [t.to(torch.bfloat16) for t in (logprobs, old)]
    for loss_fn, args in (
        (ppo_policy_loss, (*half, torch.ones(2, 3, dtype=torch.bfloat16), mask)),
        (grpo_loss, (*half, half[1], torch.ones(2, dtype=torch.bfloat16), mask)),
    ):
        loss, _ = loss_fn(*args)
        full, _ = loss_fn(*[a.float() for a in args])
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, full)  # the values are exact in bf16: no rounding in between
    losses, rewards, _ = dpo_loss(*(torch.tensor([-1.0, -2.0], dtype=torch.bfloat16),) * 4)
    assert losses.dtype == rewards.dtype == torch.float32
