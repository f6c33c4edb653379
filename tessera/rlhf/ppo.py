"""Proximal policy optimisation of a language model against a reward (InstructGPT's recipe):
the actor generates responses, the critic estimates values, a frozen reference keeps the actor
close through a per-token KL penalty, and a reward model (or rule) scores each response.

One :meth:`PPOTrainer.step` takes a batch of prompts (the same list on every rank of the job)
through:

1. **rollout**: each data rank of the actor generates for its contiguous share of the prompts
   with the paged KV cache (:class:`~tessera.rlhf.rollout.RolloutGenerator`); request ``i`` of
   the batch draws its own seed, whatever the split;
2. **experience**: the actor's log-probs, the reference's, the critic's values and the scores,
   each computed by the ranks holding that model and shared with the job
   (:class:`~tessera.rlhf.experience.Job`); then, on every rank alike, the per-token rewards
   (``score`` at the last token, ``-kl_coef * KL`` at each), GAE advantages (whitened over the
   batch) and returns;
3. **update**: ``epochs`` passes over the batch in ``minibatches`` contiguous slices, each one
   optimizer step of the actor (clipped policy loss) and one of the critic (clipped value loss),
   each engine taking its data share of the slice in its accumulation's micro-batches;
4. the KL controller's update with the batch's mean KL.

Per-token quantities are aligned to response tokens (``[B, R]``, right-padded; see
:mod:`tessera.rlhf.experience`). Rewards, advantages and returns come from the whole batch on
every rank, so a step depends on the layout only through rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.inference.params import SamplingParams
from tessera.rlhf.advantages import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, gae, per_token_rewards
from tessera.rlhf.batches import build_rollout_batch
from tessera.rlhf.dpo import logits_of
from tessera.rlhf.experience import (
    Experience,
    Job,
    RewardFn,
    actor_generator,
    response_index,
    rollout,
    to_responses,
    update,
)
from tessera.rlhf.losses import ppo_policy_loss, ppo_value_loss
from tessera.rlhf.protocols import HeldModel, TrainedModel
from tessera.rlhf.tokens import masked_mean, masked_sum, masked_whiten

__all__ = ["PPOOptions", "PPOTrainer"]


@dataclass(frozen=True)
class PPOOptions:
    """``kl_coef``: the KL penalty's coefficient (the start value when ``kl_target`` is set: the
    adaptive controller of Ziegler et al. with ``kl_horizon``); ``kl_estimator``: k1, abs, mse or
    k3; ``gamma``, ``lam``: GAE's; ``clip_eps``: the policy ratio's clip; ``clip_value``: the
    value's (None: no clipping); ``clip_score``: the score's (None: none); ``whiten_advantages``:
    normalise advantages over the batch; ``epochs``: passes over each rollout batch;
    ``minibatches``: optimizer steps per pass."""

    kl_coef: float = 0.05
    kl_target: float | None = None
    kl_horizon: float = 10000.0
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    clip_value: float | None = 0.2
    clip_score: float | None = None
    whiten_advantages: bool = True
    epochs: int = 1
    minibatches: int = 1

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"PPOOptions: kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}"
            )
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"PPOOptions: epochs and minibatches must be >= 1, got {self.epochs}, {self.minibatches}")
        if self.kl_coef < 0:
            raise ValueError(f"PPOOptions: kl_coef must be >= 0, got {self.kl_coef}")


class PPOTrainer:
    """PPO steps (module docstring). Every rank of the job builds it (collective), passing the
    models it holds and None for the others: ``actor`` and ``critic`` are engines (the critic's
    module a :class:`~tessera.rlhf.models.ValueModel`), ``reference`` a frozen model
    (:class:`~tessera.rlhf.experience.Frozen`, or a module this rank holds alone; None with
    ``kl_coef=0``), ``reward`` a frozen value model or a :data:`~tessera.rlhf.experience.RewardFn`
    (given on every rank). ``params``: how the actor samples (``max_tokens``, ``temperature``,
    ``stop_token_ids``, ...); ``pad_id``: the batches' padding id; ``generator``: keyword
    arguments of the :class:`~tessera.rlhf.rollout.RolloutGenerator` (KV-cache sizes)."""

    def __init__(
        self,
        actor: TrainedModel | None,
        critic: TrainedModel | None,
        reference: HeldModel | nn.Module | None,
        reward: HeldModel | nn.Module | RewardFn | None,
        params: SamplingParams,
        options: PPOOptions | None = None,
        *,
        pad_id: int = 0,
        generator: Mapping[str, Any] | None = None,
    ) -> None:
        self.options = options or PPOOptions()
        self.params = params
        self.pad_id = pad_id
        self.job = Job({"actor": actor, "critic": critic, "reference": reference, "reward": reward})
        for role in ("actor", "critic", "reward"):
            self.job.require(role, "PPOTrainer")
        if self.options.kl_coef > 0 or self.options.kl_target is not None:
            self.job.require("reference", "PPOTrainer (the KL penalty needs a reference; or kl_coef=0)")
        o = self.options
        self.kl = (
            AdaptiveKLController(o.kl_coef, o.kl_target, o.kl_horizon)
            if o.kl_target is not None
            else FixedKLController(o.kl_coef)
        )
        self.actor, self.critic = actor, critic
        self.generator = actor_generator(actor, params, generator)
        self.actor_logprobs = self.job.token_logprobs.get("actor")

    # ---- rollout and experience ---------------------------------------------------------------
    def rollout(self, prompts: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
        """Responses to ``prompts`` (every rank the same list), generated by the actor's data ranks
        (each its share) and shared with every rank (:func:`~tessera.rlhf.experience.rollout`)."""
        return rollout(self.job, self.generator, prompts, seed)

    @torch.no_grad()
    def experience(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> Experience:
        """The experience of ``prompts`` and their ``responses`` (module docstring, step 2), the
        same on every rank; the KL coefficient is the controller's current one."""
        o = self.options
        batch = build_rollout_batch(prompts, responses, self.pad_id)
        index, mask = response_index(batch)
        logprobs = to_responses(self.job.logprobs("actor", batch), index)
        if self.job.held("reference"):
            ref_logprobs = to_responses(self.job.logprobs("reference", batch), index)
        else:
            ref_logprobs = logprobs.clone()
        values = to_responses(self.job.values(batch), index)
        scores = self.job.scores(batch, prompts, responses).to(logprobs.device)
        rewards, kl = per_token_rewards(
            scores, logprobs, ref_logprobs, mask, self.kl.value, o.kl_estimator, o.clip_score
        )
        advantages, returns = gae(rewards, values, mask, o.gamma, o.lam)
        if o.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        tensors: dict[str, torch.Tensor] = dict(batch)  # type: ignore[arg-type]
        experience: Experience = {key: value.to(logprobs.device) for key, value in tensors.items()}
        experience.update(
            index=index.to(logprobs.device),
            mask=mask.to(logprobs.device),
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            kl=kl,
            rewards=rewards,
            advantages=advantages,
            returns=returns,
            scores=scores,
        )
        return experience

    # ---- update -------------------------------------------------------------------------------
    def _policy_losses(self, engine: TrainedModel, part: Experience) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert self.actor_logprobs is not None
        per_label = self.actor_logprobs(logits_of(engine(part["input_ids"]))[:, :-1], part["labels"])
        logprobs = to_responses(per_label, part["index"])
        return ppo_policy_loss(logprobs, part["logprobs"], part["advantages"], part["mask"], self.options.clip_eps)

    def _value_losses(self, engine: TrainedModel, part: Experience) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = to_responses(engine(part["input_ids"])[:, :-1], part["index"])
        return ppo_value_loss(values, part["values"], part["returns"], part["mask"], self.options.clip_value)

    def train(self, experience: Experience) -> dict[str, float]:
        """The update of step 3 on ``experience``: returns the policy's and the value's loss and
        statistics averaged over the optimizer steps, on every rank."""
        o = self.options
        shared = update(
            self.job,
            experience,
            o.epochs,
            o.minibatches,
            {
                "actor": (self.actor, self._policy_losses, ("loss", "clipfrac", "approx_kl", "ratio_mean")),
                "critic": (self.critic, self._value_losses, ("loss", "clipfrac")),
            },
        )
        return {
            **{f"policy/{k}": v for k, v in shared["actor"].items()},
            **{f"value/{k}": v for k, v in shared["critic"].items()},
        }

    def step(self, prompts: Sequence[Sequence[int]], seed: int) -> dict[str, float]:
        """One PPO iteration on ``prompts`` (the same list on every rank) with generation seed
        ``seed`` (give each iteration its own). Returns, on every rank: ``reward`` (mean score),
        ``kl`` (mean over rows of the summed per-token KL), ``kl_coef`` (the one used),
        ``response_length``, the ``return`` and ``value`` means, and the update's statistics."""
        responses = self.rollout(prompts, seed)
        experience = self.experience(prompts, responses)
        metrics = self.statistics(experience)
        metrics.update(self.train(experience))
        self.kl.update(metrics["kl"], len(prompts))
        return metrics

    def statistics(self, experience: Experience) -> dict[str, float]:
        """The experience's statistics (see :meth:`step`)."""
        mask = experience["mask"]
        return {
            "reward": float(experience["scores"].mean()),
            "kl": float(masked_sum(experience["kl"], mask, dim=1).mean()),
            "kl_coef": self.kl.value,
            "response_length": float(mask.sum(dim=1).float().mean()),
            "return": float(masked_mean(experience["returns"], mask)),
            "value": float(masked_mean(experience["values"], mask)),
        }

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state (the KL coefficient); the engines checkpoint themselves."""
        return {"kl": self.kl.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kl.load_state_dict(dict(state["kl"]))
