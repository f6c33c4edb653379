"""Direct preference optimisation: the policy trained on preference pairs against a frozen
reference, with no reward model and no generation (Rafailov et al., 2023).

A :class:`DPOTrainer` drives an :class:`~tessera.engine.Engine` (the policy, under any layout
``tessera.initialize`` gives it) through pair batches (:func:`~tessera.rlhf.batches.collate_pairs`:
the chosen rows, then the rejected rows). Each micro-batch takes one forward of the policy and one
of the reference over all ``2B`` rows; each row's response log-probability is the sum of its
response tokens' log-probs; :func:`~tessera.rlhf.losses.dpo_loss` gives the loss. With
``reference_free`` there is no reference model.

The reference is any callable from ``input_ids`` to logits (or to an output with ``.logits``): a
copy of the policy's starting weights built under the same layout and frozen, a model under
a layout of its own, or the policy's own base with its LoRA adapters off
(:func:`~tessera.rlhf.adapters.adapters_off`). It runs under ``torch.no_grad`` and in eval mode,
before the policy's forward of the same micro-batch: a forward through the policy's engine
without gradients tells its strategy that no accumulation follows, which after the policy's
forward would reduce the gradients of a micro-step that does not end the step (traffic for
nothing: the reduction is linear, the step the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.rlhf import steps
from tessera.rlhf.batches import SequenceBatch, split_pairs
from tessera.rlhf.losses import DPO_LOSS_TYPES, dpo_loss
from tessera.rlhf.models import token_logprobs_fn
from tessera.rlhf.protocols import TrainedModel
from tessera.rlhf.tokens import LogprobsFn, masked_mean, masked_sum, token_logprobs

__all__ = ["DPOOptions", "DPOTrainer", "logits_of", "response_logprobs"]


@dataclass(frozen=True)
class DPOOptions:
    """``beta``: the strength of the KL constraint to the reference; ``loss_type``: ``"sigmoid"``
    (DPO), ``"hinge"`` (SLiC) or ``"ipo"`` (on per-token mean log-probs, as its authors define
    it); ``label_smoothing``: cDPO's probability that a label is wrong (sigmoid only);
    ``reference_free``: the reference's log-probs taken as 0 (no reference model)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"DPOOptions: loss_type must be one of {list(DPO_LOSS_TYPES)}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"DPOOptions: beta must be > 0, got {self.beta}")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a causal LM's output: the tensor itself (tessera's GPT) or ``.logits``
    (Hugging Face)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(f"expected [B, T, V] logits (or an output with .logits), got {type(output).__name__}")
    return logits


def response_logprobs(
    logits: torch.Tensor, batch: SequenceBatch, *, mean: bool = False, logprobs: LogprobsFn = token_logprobs
) -> torch.Tensor:
    """Each row's response log-probability ``[B]``: the sum (``mean``: the per-token mean) over
    its response tokens of ``log p(label)``, from ``[B, T, V]`` logits of ``batch["input_ids"]``
    (the last position predicts nothing and is dropped). ``logprobs``: how token log-probs are
    taken from logits (vocabulary-parallel logits need the tensor group's)."""
    per_token = logprobs(logits[:, :-1], batch["labels"])
    mask = batch["response_mask"]
    return masked_mean(per_token, mask, dim=1) if mean else masked_sum(per_token, mask, dim=1)


class DPOTrainer:
    """DPO steps of ``policy`` (an engine) against ``reference`` (a frozen callable, or None
    with ``options.reference_free``)."""

    def __init__(
        self,
        policy: TrainedModel,
        reference: Callable[[torch.Tensor], Any] | None,
        options: DPOOptions | None = None,
        *,
        logprobs: LogprobsFn | None = None,
    ) -> None:
        self.policy = policy
        self.options = options or DPOOptions()
        if reference is None and not self.options.reference_free:
            raise ValueError("DPOTrainer: give a reference model, or DPOOptions(reference_free=True)")
        self.reference = None if self.options.reference_free else reference
        if isinstance(self.reference, torch.nn.Module):
            self.reference.eval().requires_grad_(False)
        # vocabulary-parallel logits (tessera's GPT under 1D tensor parallelism) need their group's
        self.logprobs = logprobs or token_logprobs_fn(policy.module)
        self.reference_logprobs = (
            token_logprobs_fn(self.reference) if isinstance(self.reference, torch.nn.Module) else self.logprobs
        )

    def _pair_logprobs(
        self, logits: torch.Tensor, batch: SequenceBatch, logprobs: LogprobsFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        each = response_logprobs(logits, batch, mean=self.options.loss_type == "ipo", logprobs=logprobs)
        return split_pairs(each)

    def _reference_logprobs(self, batch: SequenceBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.reference is None:
            return None, None
        with torch.no_grad():
            return self._pair_logprobs(logits_of(self.reference(batch["input_ids"])), batch, self.reference_logprobs)

    def losses(
        self,
        logits: torch.Tensor,
        batch: SequenceBatch,
        reference: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean DPO loss of the policy's ``logits`` on ``batch`` and its statistics (detached):
        implicit rewards of chosen and rejected, their margin, and the pairs ranked right.
        ``reference``: the reference's ``(chosen, rejected)`` log-probs ``[B]`` taken already
        (None: taken here)."""
        chosen, rejected = self._pair_logprobs(logits, batch, self.logprobs)
        ref_chosen, ref_rejected = self._reference_logprobs(batch) if reference is None else reference
        o = self.options
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, o.beta, o.loss_type, o.label_smoothing, o.reference_free
        )
        margin = chosen_rewards - rejected_rewards
        stats = {
            "chosen_reward": chosen_rewards.mean(),
            "rejected_reward": rejected_rewards.mean(),
            "margin": margin.mean(),
            "accuracy": (margin > 0).float().mean(),
        }
        return losses.mean(), stats

    def _engine_losses(
        self, engine: TrainedModel, batch: SequenceBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        reference = self._reference_logprobs(batch)  # first: module docstring
        return self.losses(logits_of(engine(batch["input_ids"])), batch, reference)

    def train_step(self, micro_batches: Iterable[SequenceBatch]) -> dict[str, float]:
        """One optimizer step over the engine's accumulation of ``micro_batches`` (this rank's
        pairs); the loss and statistics averaged over the micro-batches and the data ranks."""
        return steps.train_step(self.policy, micro_batches, self._engine_losses)

    def evaluate(self, batches: Iterable[SequenceBatch]) -> dict[str, float]:
        """The loss and statistics over ``batches`` (held-out pairs), averaged over them and the
        data ranks, in eval mode."""
        return steps.evaluate(self.policy, batches, self._engine_losses)
