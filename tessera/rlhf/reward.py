"""Reward modelling: a value model trained on preference pairs to score the chosen response above
the rejected one (the Bradley-Terry loss of InstructGPT), and the scores PPO takes from it.

A :class:`RewardTrainer` drives an :class:`~tessera.engine.Engine` whose model is a
:class:`~tessera.rlhf.models.ValueModel` (``value_model(gpt(...))``, a Hugging Face causal LM
through :func:`~tessera.rlhf.models.value_model`, under any layout those take) through pair
batches (:func:`~tessera.rlhf.batches.collate_pairs`: the chosen rows, then the rejected rows).
One forward over all ``2B`` rows gives a value per position; a row's score is the value at its
last real token (:func:`~tessera.rlhf.models.sequence_values` with ``last_index``), and
:func:`~tessera.rlhf.losses.pairwise_reward_loss` of the chosen and rejected scores is the loss.

A reward model learns score differences only: any constant added to every score leaves the loss
as it is. ``center_rewards_coefficient`` adds ``c * mean((chosen + rejected)^2)`` to the loss
(Eisenstein et al., 2023; TRL's ``RewardConfig``), which keeps the scores near 0, where PPO's
KL-penalised rewards expect them.

:func:`reward_scores` gives the scores of any :class:`~tessera.rlhf.batches.SequenceBatch` (rollouts
from :func:`~tessera.rlhf.rollout.rollout_batch`) under a trained reward model, without
gradients and in eval mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.rlhf import steps
from tessera.rlhf.batches import SequenceBatch, split_pairs
from tessera.rlhf.losses import pairwise_reward_loss
from tessera.rlhf.models import ValueModel, sequence_values
from tessera.rlhf.protocols import TrainedModel
from tessera.rlhf.rollout import generation_mode

__all__ = ["RewardOptions", "RewardTrainer", "reward_scores"]


@dataclass(frozen=True)
class RewardOptions:
    """``center_rewards_coefficient``: the weight ``c >= 0`` of ``mean((chosen + rejected)^2)``
    added to the loss, which pulls the scores towards 0 (0: the plain pairwise loss)."""

    center_rewards_coefficient: float = 0.0

    def __post_init__(self) -> None:
        if not self.center_rewards_coefficient >= 0:  # nan included
            raise ValueError(
                f"RewardOptions: center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}"
            )


def _values(model: Any, batch: SequenceBatch) -> torch.Tensor:
    return model(batch["input_ids"], attention_mask=batch["attention_mask"])


@torch.no_grad()
def reward_scores(model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Each row's score under the reward model ``model`` (a :class:`~tessera.rlhf.models.ValueModel`,
    e.g. a trainer's ``engine.module``): the value at its last real token, ``[B]`` float32 on the
    model's device. Runs without gradients and in eval mode (every module's train/eval flag put
    back after). ``batch``: a :class:`~tessera.rlhf.batches.SequenceBatch` (``input_ids``,
    ``attention_mask``, ``last_index``), on any device."""
    if not isinstance(model, ValueModel):
        raise TypeError(
            f"reward_scores takes a value model (tessera.rlhf.value_model(...)), got {type(model).__name__}; "
            "with an engine, pass engine.module"
        )
    batch = steps.to_device(batch, model.score.weight.device)
    with generation_mode(model):  # eval mode, flags restored: dropout off while scoring
        return sequence_values(_values(model, batch), batch["last_index"])


class RewardTrainer:
    """Reward-model steps of ``engine``, whose model is a :class:`~tessera.rlhf.models.ValueModel`
    (``input_ids [B, T]``, ``attention_mask`` -> values ``[B, T]``)."""

    def __init__(self, engine: TrainedModel, options: RewardOptions | None = None) -> None:
        if not isinstance(engine.module, ValueModel):
            raise TypeError(
                f"RewardTrainer trains a value model (tessera.rlhf.value_model(...)), got "
                f"{type(engine.module).__name__}; build the engine on value_model(your_model)"
            )
        self.engine = engine
        self.options = options or RewardOptions()

    def losses(self, values: torch.Tensor, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean pairwise loss of the values ``[2B, T]`` of a pair batch (chosen rows, then
        rejected rows), plus the centring term when its coefficient is not 0, a 0-d float32
        tensor, and its statistics (detached): the mean score of the chosen and of the rejected
        responses, their mean margin, and the fraction of pairs ranked right."""
        chosen, rejected = split_pairs(sequence_values(values, batch["last_index"]))
        loss, accuracy = pairwise_reward_loss(chosen, rejected)
        c = self.options.center_rewards_coefficient
        if c:
            loss = loss + c * (chosen.float() + rejected.float()).square().mean()
        chosen, rejected = chosen.detach().float(), rejected.detach().float()
        stats = {
            "chosen_reward": chosen.mean(),
            "rejected_reward": rejected.mean(),
            "margin": (chosen - rejected).mean(),
            "accuracy": accuracy,
        }
        return loss, stats

    def _engine_losses(
        self, engine: TrainedModel, batch: SequenceBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.losses(_values(engine, batch), batch)

    def train_step(self, micro_batches: Iterable[SequenceBatch]) -> dict[str, float]:
        """One optimizer step over the engine's accumulation of ``micro_batches`` (this rank's
        pairs); the loss and statistics averaged over the micro-batches and the data ranks."""
        return steps.train_step(self.engine, micro_batches, self._engine_losses)

    def evaluate(self, batches: Iterable[SequenceBatch]) -> dict[str, float]:
        """The loss and statistics over ``batches`` (held-out pairs), averaged over them and the
        data ranks, in eval mode."""
        return steps.evaluate(self.engine, batches, self._engine_losses)

    @torch.no_grad()
    def score(self, batch: SequenceBatch) -> torch.Tensor:
        """Each row's score under the engine's model, as :func:`reward_scores` gives it (``[B]`` float32, no
        gradients, eval mode; train mode put back after), through the engine's forward so that
        any strategy's parameters take part (ZeRO-3's and Gemini's among them)."""
        self.engine.eval()
        try:
            batch = steps.to_device(batch, self.engine.ctx.device)
            return sequence_values(_values(self.engine, batch), batch["last_index"])
        finally:
            self.engine.train()
