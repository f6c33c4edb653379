"""The reference model of a policy that trains LoRA adapters: its own frozen base with the
adapters switched off (:class:`AdaptersOff`), so that DPO, PPO and GRPO hold one copy of the base
instead of two (a separate reference is a second copy of the same frozen weights).

The base runs through the policy's own forward: an engine's (its layout, autocast and sharded
weights, as a separate frozen engine would run them) or a module's, in eval mode and without
gradients, and with the adapters off (:func:`tessera.lora.disabled`); the policy is left as it
was (its mode, its adapters). A forward through the engine tells its strategy that no gradient
follows (``final``): DPO therefore takes the reference's log-probs before the policy's forward of
the same micro-batch (:class:`~tessera.rlhf.dpo.DPOTrainer`; after it, a micro-step inside an
accumulation would reduce its gradients for nothing), and PPO and GRPO take them with the
rollout's other log-probs, between training steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera import lora
from tessera.context import ParallelContext
from tessera.errors import ConfigError


class AdaptersOff:
    """``policy`` (an engine, or a module with :mod:`tessera.lora` adapters) seen as its frozen
    base: called as the policy is (``input_ids [B, T] -> logits``), it runs the policy's forward
    in eval mode, without gradients, with every adapter off. A held model of the ranks that hold
    the policy (``ctx``: the engine's; a module's: this rank alone). Raises ConfigError for a
    policy without adapters."""

    def __init__(self, policy: Any) -> None:
        module = getattr(policy, "module", policy)
        if not isinstance(module, nn.Module) or not lora.adapters(module):
            raise ConfigError("adapters_off: the policy has no LoRA adapters (tessera.lora.apply puts them on)")
        self.policy, self._module = policy, module
        ctx = getattr(policy, "ctx", None)
        if ctx is None:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            ctx = ParallelContext.alone(device)
        self._ctx: ParallelContext = ctx

    @property
    def ctx(self) -> ParallelContext:
        return self._ctx

    @property
    def module(self) -> nn.Module:
        """The policy's module (its adapters switched off only while this runs)."""
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self._module.training
        self._module.eval()  # as a frozen reference runs: no dropout
        try:
            with torch.no_grad(), lora.disabled(self._module):
                return self.policy(*args, **kwargs)
        finally:
            self._module.train(training)


def adapters_off(policy: Any) -> AdaptersOff:
    """The frozen base of ``policy`` (an engine, or a model with ``tessera.lora`` adapters) as
    a reference model (:class:`AdaptersOff`): DPO and PPO then hold one copy of the base instead
    of two. Raises ConfigError for a model without adapters."""
    return AdaptersOff(policy)


__all__ = ["AdaptersOff", "adapters_off"]
