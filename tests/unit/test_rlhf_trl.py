"""tessera.rlhf.losses against TRL's own code on the same inputs (the test extra pins ``trl``).

TRL computes its losses inside trainer methods, so the tests call those methods unbound on a
namespace holding just the attributes they read (``DPOTrainer._compute_loss``,
``GRPOTrainer._compute_loss``, ``RewardTrainer.compute_loss``) with a stand-in model that returns
fixed logits, and compare losses, logged metrics and gradients. Module-level helpers
(``selective_log_softmax``, ``nanstd``, PPO's ``masked_mean``/``masked_var``/``masked_whiten``)
are called directly. These private signatures change between TRL releases, hence the exact pin.

Not compared, because TRL has no function to call: the GAE recursion, the per-token KL rewards,
and PPO's policy and value losses live inline in ``PPOTrainer.train``; TRL 1.x has no KL
controller. ``tests/unit/test_rlhf_losses.py`` checks those by hand.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.reward_trainer import RewardTrainer
    from trl.trainer.utils import nanstd, selective_log_softmax

    with warnings.catch_warnings():  # "trl.experimental may change": the exact pin is the answer
        warnings.simplefilter("ignore")
        from trl.experimental.ppo import ppo_trainer as trl_ppo
except ImportError as error:  # a missing test extra is a failure here, never a skip
    raise ImportError(
        f"{__name__} compares tessera.rlhf with TRL: install the test extra (pip install -e '.[test]'): {error}"
    ) from error

from tessera.rlhf import (
    dpo_loss,
    grpo_advantages,
    grpo_loss,
    masked_mean,
    masked_sum,
    masked_whiten,
    pairwise_reward_loss,
    sft_loss,
    token_logprobs,
)


class SingleProcessAccelerator:
    """What TRL's loss methods ask of accelerate's ``Accelerator``, for a world of one process."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def trainer_namespace(**attributes) -> SimpleNamespace:
    """A stand-in ``self`` for an unbound TRL trainer method: a training-mode model, one process."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SingleProcessAccelerator(),
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        **attributes,
    )


def fixed_logits_model(logits: torch.Tensor):
    """A model whose forward ignores its inputs and returns ``logits``."""
    return lambda **inputs: SimpleNamespace(logits=logits)


# --- log-probabilities and masked statistics --------------------------------------------------


def test_token_logprobs_matches_selective_log_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=generator) * 3
    tokens = torch.randint(0, 50, (3, 7), generator=generator)
    torch.testing.assert_close(token_logprobs(logits, tokens), selective_log_softmax(logits, tokens))
    # TRL takes a bf16 log_softmax (rounded to bf16); tessera's float32 result lies within that rounding
    half = logits.to(torch.bfloat16)
    torch.testing.assert_close(
        token_logprobs(half, tokens), selective_log_softmax(half, tokens).float(), rtol=1e-2, atol=2e-2
    )


def test_masked_statistics_match_trl_ppo_helpers():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(4, 6, generator=generator) * 2 + 1
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 3:] = mask[2, 1:] = mask[3, 5:] = False
    torch.testing.assert_close(masked_mean(values, mask), trl_ppo.masked_mean(values, mask))
    torch.testing.assert_close(masked_mean(values, mask, dim=1), trl_ppo.masked_mean(values, mask, axis=1))
    for shift_mean in (True, False):
        ours = masked_whiten(values, mask, shift_mean=shift_mean)
        theirs = trl_ppo.masked_whiten(values, mask, shift_mean=shift_mean)
        torch.testing.assert_close(ours[mask], theirs[mask])  # TRL leaves the padded slots as they come out
    # the unbiased variance both use: whitened real entries have unit (Bessel-corrected) variance
    torch.testing.assert_close(trl_ppo.masked_var(masked_whiten(values, mask), mask), torch.tensor(1.0))


# --- SFT and reward model ---------------------------------------------------------------------


def preference_batch(seed: int, pairs: int = 3, length: int = 9, vocab: int = 17) -> dict[str, torch.Tensor]:
    """``2 * pairs`` right-padded sequences, chosen rows first: a prompt of 3 tokens, then a response
    of 2 to 6 tokens, then padding (id 0), with fixed policy logits and reference log-probs."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (2 * pairs, length), generator=generator)
    completion_mask = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):
        end = 3 + int(torch.randint(2, length - 2, (), generator=generator))
        completion_mask[row, 3:end] = 1
        input_ids[row, end:] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != 0).long() | completion_mask,
        "completion_mask": completion_mask,
        "logits": torch.randn(2 * pairs, length, vocab, generator=generator) * 2,
        "ref_chosen_logps": -torch.rand(pairs, generator=generator) * 10 - 5,
        "ref_rejected_logps": -torch.rand(pairs, generator=generator) * 10 - 5,
    }


def test_sft_loss_matches_the_causal_lm_loss_trl_sft_uses():
    batch = preference_batch(seed=2)
    logits, input_ids, completion_mask = batch["logits"], batch["input_ids"], batch["completion_mask"]
    # TRL's SFTTrainer takes the model's loss: transformers' ForCausalLMLoss, which shifts the labels
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    reference = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])
    ours = sft_loss(logits[:, :-1], input_ids[:, 1:], completion_mask[:, 1:])
    torch.testing.assert_close(ours, reference)


def test_sft_loss_matches_trl_dpo_sft_loss_type():
    batch = preference_batch(seed=3)
    logits = batch.pop("logits").requires_grad_(True)
    trainer = trainer_namespace(
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sft"],
        loss_weights=[1.0],
        beta=0.1,
        label_smoothing=0.0,
        use_weighting=False,
    )
    trl_loss = DPOTrainer._compute_loss(trainer, fixed_logits_model(logits), dict(batch), return_outputs=False)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)
    pairs = logits.shape[0] // 2
    chosen = slice(0, pairs)  # TRL's SFT term trains on the chosen responses
    ours = sft_loss(logits[chosen, :-1], batch["input_ids"][chosen, 1:], batch["completion_mask"][chosen, 1:])
    (our_grad,) = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(ours, trl_loss)
    torch.testing.assert_close(our_grad, trl_grad)


@pytest.mark.parametrize("with_margin", [False, True])
def test_pairwise_reward_loss_matches_trl_reward_trainer(with_margin):
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(8, 1, generator=generator) * 2  # the reward model's logits: 4 chosen, then 4 rejected
    inputs = {"input_ids": torch.ones(8, 5, dtype=torch.long), "attention_mask": torch.ones(8, 5, dtype=torch.long)}
    margin = torch.rand(4, generator=generator)
    if with_margin:
        inputs["margin"] = margin
    trainer = trainer_namespace(args=SimpleNamespace(center_rewards_coefficient=None))
    trl_loss = RewardTrainer.compute_loss(trainer, fixed_logits_model(scores), inputs)
    loss, accuracy = pairwise_reward_loss(scores[:4, 0], scores[4:, 0], margin if with_margin else None)
    torch.testing.assert_close(loss, trl_loss)
    assert accuracy.item() == pytest.approx(trainer._metrics["train"]["accuracy"][-1])


# --- DPO --------------------------------------------------------------------------------------


def sequence_logps(batch: dict[str, torch.Tensor], logits: torch.Tensor, per_token: bool) -> torch.Tensor:
    """Each response's log-prob (summed, or averaged per token) from next-token logits."""
    logprobs = token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])
    mask = batch["completion_mask"][:, 1:]
    return masked_mean(logprobs, mask, dim=1) if per_token else masked_sum(logprobs, mask, dim=1)


def run_trl_dpo(batch: dict[str, torch.Tensor], logits: torch.Tensor, loss_type: str, beta: float, **extra):
    trainer = trainer_namespace(
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        **extra,
    )
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    loss = DPOTrainer._compute_loss(trainer, fixed_logits_model(logits), inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_matches_trl(loss_type):
    batch = preference_batch(seed=5, pairs=4)
    beta = 0.2
    logits = batch["logits"].clone().requires_grad_(True)
    trl_loss, metrics = run_trl_dpo(batch, logits, loss_type, beta, label_smoothing=0.0)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)

    # IPO is defined on per-token averages: TRL divides the summed log-ratios by the response length
    per_token = loss_type == "ipo"
    logps = sequence_logps(batch, logits, per_token)
    lengths = batch["completion_mask"].sum(dim=1).float()
    ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    if per_token:
        ref_chosen, ref_rejected = ref_chosen / lengths[:4], ref_rejected / lengths[4:]
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        logps[:4], logps[4:], ref_chosen, ref_rejected, beta=beta, loss_type=loss_type
    )
    (our_grad,) = torch.autograd.grad(losses.mean(), logits)
    torch.testing.assert_close(losses.mean(), trl_loss)
    torch.testing.assert_close(our_grad, trl_grad)
    if not per_token:  # TRL logs the rewards of the summed log-ratios
        assert chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"][-1], rel=1e-5)
        assert rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"][-1], rel=1e-5)
        margins = (chosen_rewards - rejected_rewards).mean().item()
        assert margins == pytest.approx(metrics["rewards/margins"][-1], rel=1e-5)


def test_dpo_label_smoothing_matches_trl_conservative_form():
    # TRL 1.x dropped label smoothing from "sigmoid"; its cDPO form -(1-e) log s(bh) - e log s(-bh)
    # lives on in "aot_unpaired", which on one pair (nothing to sort) is exactly cDPO
    batch = preference_batch(seed=6, pairs=3)
    beta, smoothing = 0.3, 0.15
    logps = sequence_logps(batch, batch["logits"], per_token=False)
    losses, _, _ = dpo_loss(
        logps[:3],
        logps[3:],
        batch["ref_chosen_logps"],
        batch["ref_rejected_logps"],
        beta=beta,
        label_smoothing=smoothing,
    )
    for pair in range(3):
        rows = [pair, 3 + pair]
        one_pair = {
            "input_ids": batch["input_ids"][rows],
            "attention_mask": batch["attention_mask"][rows],
            "completion_mask": batch["completion_mask"][rows],
            "ref_chosen_logps": batch["ref_chosen_logps"][[pair]],
            "ref_rejected_logps": batch["ref_rejected_logps"][[pair]],
        }
        trl_loss, _ = run_trl_dpo(one_pair, batch["logits"][rows], "aot_unpaired", beta, label_smoothing=smoothing)
        torch.testing.assert_close(losses[pair], trl_loss)


# --- GRPO -------------------------------------------------------------------------------------


def test_grpo_advantages_match_trl_group_normalisation():
    generator = torch.Generator().manual_seed(7)
    group_size = 4
    rewards = torch.randint(0, 3, (5 * group_size,), generator=generator).float()
    rewards[:group_size] = 1.0  # one group with nothing to tell apart: std 0, advantage 0
    # GRPOTrainer._generate_and_score_completions, scale_rewards="group": (r - mean) / (nanstd + 1e-4)
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    std = nanstd(grouped, dim=1).repeat_interleave(group_size)
    torch.testing.assert_close(grpo_advantages(rewards, group_size), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(grpo_advantages(rewards, group_size, scale=False), rewards - mean)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl(loss_type, beta):
    generator = torch.Generator().manual_seed(8)
    batch, length, eps = 6, 7, 0.2
    completion_mask = torch.ones(batch, length, dtype=torch.long)
    for row, end in enumerate([7, 3, 5, 1, 6, 4]):
        completion_mask[row, end:] = 0
    logprobs = (-torch.rand(batch, length, generator=generator) * 3).requires_grad_(True)
    old = logprobs.detach() + 0.4 * torch.randn(batch, length, generator=generator)  # some ratios clip
    ref = logprobs.detach() + 0.3 * torch.randn(batch, length, generator=generator)
    advantages = torch.randn(batch, generator=generator)
    trainer = trainer_namespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=length,
        _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
    )
    inputs = {
        "prompt_ids": torch.ones(batch, 2, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 2, dtype=torch.long),
        "completion_ids": torch.ones(batch, length, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    trl_loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logprobs)
    metrics = trainer._metrics["train"]

    loss, stats = grpo_loss(logprobs, old, ref if beta else None, advantages, completion_mask, eps, beta, loss_type)
    (our_grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(loss, trl_loss)
    torch.testing.assert_close(our_grad, trl_grad)
    assert 0 < stats["clipfrac"].item() == pytest.approx(metrics["clip_ratio/region_mean"][-1], rel=1e-6)
    if beta:
        assert stats["kl"].item() == pytest.approx(metrics["kl"][-1], rel=1e-6)
