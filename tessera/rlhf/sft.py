"""Supervised fine-tuning: a causal LM trained on demonstrations, the loss on response tokens only.

An :class:`SFTTrainer` drives an :class:`~tessera.engine.Engine` (the model, under any layout
``tessera.initialize`` gives it) through :class:`~tessera.rlhf.batches.SFTBatch` es
(:func:`~tessera.rlhf.batches.collate_sft`). The loss of a micro-batch is the next-token
cross-entropy averaged over its response tokens (``loss_mask``): prompt tokens and padding never
count, and each response token weighs the same whichever row it is in (the token-level mean of
:func:`~tessera.rlhf.losses.sft_loss`, and of Hugging Face's ``labels`` with -100 on the prompt).

It is taken as the negated mean of the labels' token log-probs, with the log-prob function the
model's logits need (:func:`~tessera.rlhf.models.token_logprobs_fn`): tessera's GPT under 1D
tensor parallelism gives each rank a block of the vocabulary, whose log-softmax runs over the
tensor group. In one process it is :func:`~tessera.rlhf.losses.sft_loss` exactly.

The model is called on ``input_ids`` alone, as :mod:`~tessera.rlhf.dpo` calls it: batches are
right-padded, so causal attention never lets a real token see the padding after it (tessera's
GPT takes no attention mask).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tessera.rlhf import steps
from tessera.rlhf.batches import SFTBatch
from tessera.rlhf.dpo import logits_of
from tessera.rlhf.models import token_logprobs_fn
from tessera.rlhf.protocols import TrainedModel
from tessera.rlhf.tokens import LogprobsFn, bool_mask, check_per_token, masked_mean

__all__ = ["SFTTrainer"]


class SFTTrainer:
    """SFT steps of ``engine`` (a causal LM: ``input_ids [B, T]`` -> logits ``[B, T, V]``, or an
    output with ``.logits``). ``logprobs``: how token log-probs are taken from its logits
    (default: :func:`~tessera.rlhf.models.token_logprobs_fn` of ``engine.module``)."""

    def __init__(self, engine: TrainedModel, *, logprobs: LogprobsFn | None = None) -> None:
        self.engine = engine
        # vocabulary-parallel logits (tessera's GPT under 1D tensor parallelism) need their group's
        self.logprobs = logprobs or token_logprobs_fn(engine.module)

    def losses(self, logits: torch.Tensor, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean cross-entropy over the response tokens of ``batch`` under ``logits`` (``[B, T,
        V]``, or this rank's ``[B, T, V/P]`` block with a vocabulary-parallel ``logprobs``; row
        ``b``, position ``t`` predicting ``batch["labels"][b, t]``), a 0-d float32 tensor, and its
        statistics: ``"tokens"``, the number of response tokens (the loss's denominator). An
        all-false ``loss_mask`` gives 0. ``exp`` of the loss is the perplexity of the responses."""
        labels, mask = batch["labels"], bool_mask(batch["loss_mask"])
        check_per_token("SFTTrainer", ("labels", labels), ("loss_mask", mask))
        # masked-out labels are never read; any id in the vocabulary keeps the gather in range
        safe_labels = torch.where(mask, labels, torch.zeros((), dtype=labels.dtype, device=labels.device))
        loss = -masked_mean(self.logprobs(logits, safe_labels), mask)
        return loss, {"tokens": mask.sum().float()}

    def _engine_losses(self, engine: TrainedModel, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.losses(logits_of(engine(batch["input_ids"])), batch)

    def train_step(self, micro_batches: Iterable[SFTBatch]) -> dict[str, float]:
        """One optimizer step over the engine's accumulation of ``micro_batches`` (this rank's
        examples); the loss and ``"tokens"``, each averaged over the micro-batches and the data
        ranks."""
        return steps.train_step(self.engine, micro_batches, self._engine_losses)

    def evaluate(self, batches: Iterable[SFTBatch]) -> dict[str, float]:
        """The loss and ``"tokens"`` over ``batches`` (held-out examples), averaged over them and
        the data ranks, in eval mode."""
        return steps.evaluate(self.engine, batches, self._engine_losses)
