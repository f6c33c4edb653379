"""Group relative policy optimisation (Shao et al., 2024, DeepSeekMath): PPO without a critic.
Each prompt gets a group of ``group_size`` responses; a response's advantage is its reward
against the group's (:func:`~tessera.rlhf.advantages.grpo_advantages`), applied to every token
of it; an optional k3 KL term keeps the policy near a frozen reference.

One :meth:`GRPOTrainer.step` takes prompts (the same list on every rank of the job): the actor's
data ranks generate the groups (each its contiguous share of the ``prompts x group_size`` rows,
each row with its own seed), the rewards and, when needed, the actor's and the reference's
log-probs are shared with every rank (:class:`~tessera.rlhf.experience.Job`), and the actor
takes ``epochs x minibatches`` optimizer steps of :func:`~tessera.rlhf.losses.grpo_loss`. With
one step per generation the old log-probs are the current ones, detached (the ratio is 1 and
only its gradient counts), so they are not computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.inference.params import SamplingParams
from tessera.rlhf.advantages import grpo_advantages
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
from tessera.rlhf.losses import GRPO_LOSS_TYPES, grpo_loss
from tessera.rlhf.protocols import HeldModel, TrainedModel

__all__ = ["GRPOOptions", "GRPOTrainer"]


@dataclass(frozen=True)
class GRPOOptions:
    """``group_size``: responses per prompt; ``beta``: the KL term's weight (0: no reference
    needed); ``clip_eps``: the ratio's clip; ``loss_type``: ``"grpo"``, ``"bnpo"`` or ``"dr_grpo"``
    (how tokens are averaged, :func:`~tessera.rlhf.losses.grpo_loss`); ``scale_rewards``: divide
    by the group's standard deviation (False: Dr. GRPO); ``epochs``, ``minibatches``: passes over
    each batch of groups and optimizer steps per pass."""

    group_size: int = 4
    beta: float = 0.04
    clip_eps: float = 0.2
    loss_type: str = "grpo"
    scale_rewards: bool = True
    epochs: int = 1
    minibatches: int = 1

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"GRPOOptions: group_size must be >= 2, got {self.group_size}")
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"GRPOOptions: loss_type must be one of {list(GRPO_LOSS_TYPES)}, got {self.loss_type!r}")
        if self.beta < 0:
            raise ValueError(f"GRPOOptions: beta must be >= 0, got {self.beta}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"GRPOOptions: epochs and minibatches must be >= 1, got {self.epochs}, {self.minibatches}")

    @property
    def reuses_rollouts(self) -> bool:
        """Whether a batch takes more than one optimizer step (then the old log-probs are needed)."""
        return self.epochs * self.minibatches > 1


class GRPOTrainer:
    """GRPO steps (module docstring). Every rank of the job builds it (collective), passing the
    models it holds and None for the others: ``actor`` an engine, ``reference`` a frozen model
    (None with ``beta=0``), ``reward`` a frozen value model or a
    :data:`~tessera.rlhf.experience.RewardFn` (given on every rank). ``params`` must sample (a
    group of greedy responses would be one response ``group_size`` times)."""

    def __init__(
        self,
        actor: TrainedModel | None,
        reference: HeldModel | nn.Module | None,
        reward: HeldModel | nn.Module | RewardFn | None,
        params: SamplingParams,
        options: GRPOOptions | None = None,
        *,
        pad_id: int = 0,
        generator: Mapping[str, Any] | None = None,
    ) -> None:
        self.options = options or GRPOOptions()
        if params.greedy:
            raise ValueError("GRPOTrainer: params must sample (temperature > 0): a group needs different responses")
        self.params, self.pad_id = params, pad_id
        self.job = Job({"actor": actor, "reference": reference, "reward": reward})
        self.job.require("actor", "GRPOTrainer")
        self.job.require("reward", "GRPOTrainer")
        if self.options.beta > 0:
            self.job.require("reference", "GRPOTrainer (beta > 0 needs a reference; or beta=0)")
        self.actor = actor
        self.generator = actor_generator(actor, params, generator)
        self.actor_logprobs = self.job.token_logprobs.get("actor")

    def groups(self, prompts: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """Each prompt ``group_size`` times, a group's rows next to each other."""
        return [prompt for prompt in prompts for _ in range(self.options.group_size)]

    @torch.no_grad()
    def experience(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> Experience:
        """The experience of the grouped ``prompts`` (:meth:`groups`) and their ``responses``, the
        same on every rank: the batch, ``index``/``mask``, ``scores``, ``advantages [B]``, and the
        actor's (``logprobs``, when a batch takes several steps) and the reference's
        (``ref_logprobs``, when ``beta > 0``) response log-probs."""
        o = self.options
        batch = build_rollout_batch(prompts, responses, self.pad_id)
        index, mask = response_index(batch)
        scores = self.job.scores(batch, prompts, responses).float()
        tensors: dict[str, torch.Tensor] = dict(batch)  # type: ignore[arg-type]
        experience: Experience = {key: value.to(self.job.device) for key, value in tensors.items()}
        experience.update(
            index=index.to(self.job.device),
            mask=mask.to(self.job.device),
            scores=scores.to(self.job.device),
            advantages=grpo_advantages(scores, o.group_size, scale=o.scale_rewards).to(self.job.device),
        )
        if o.reuses_rollouts:
            experience["logprobs"] = to_responses(self.job.logprobs("actor", batch), index)
        if o.beta > 0:
            experience["ref_logprobs"] = to_responses(self.job.logprobs("reference", batch), index)
        return experience

    def _losses(self, engine: TrainedModel, part: Experience) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert self.actor_logprobs is not None
        o = self.options
        per_label = self.actor_logprobs(logits_of(engine(part["input_ids"]))[:, :-1], part["labels"])
        logprobs = to_responses(per_label, part["index"])
        return grpo_loss(
            logprobs,
            part.get("logprobs"),
            part.get("ref_logprobs"),
            part["advantages"],
            part["mask"],
            o.clip_eps,
            o.beta,
            o.loss_type,
        )

    def train(self, experience: Experience) -> dict[str, float]:
        """The actor's ``epochs x minibatches`` optimizer steps on ``experience``: the loss and its
        statistics averaged over them, on every rank."""
        o = self.options
        keys = ("loss", "clipfrac", "ratio_mean", *(("kl",) if o.beta > 0 else ()))
        return update(self.job, experience, o.epochs, o.minibatches, {"actor": (self.actor, self._losses, keys)})[
            "actor"
        ]

    def step(self, prompts: Sequence[Sequence[int]], seed: int) -> dict[str, float]:
        """One GRPO iteration on ``prompts`` (the same list on every rank) with generation seed
        ``seed``. Returns, on every rank: ``reward`` (mean score), ``reward_std`` (the mean over
        groups of their standard deviation: 0 means nothing to learn from), ``response_length``,
        and the update's ``loss``, ``clipfrac``, ``ratio_mean`` and ``kl`` (with ``beta > 0``)."""
        grouped = self.groups(prompts)
        responses = rollout(self.job, self.generator, grouped, seed)
        experience = self.experience(grouped, responses)
        scores = experience["scores"].view(-1, self.options.group_size)
        metrics = {
            "reward": float(scores.mean()),
            "reward_std": float(scores.std(dim=1).mean()),
            "response_length": float(experience["mask"].sum(dim=1).float().mean()),
        }
        metrics.update(self.train(experience))
        return metrics
