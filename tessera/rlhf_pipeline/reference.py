"""The reference of a ``tessera rlhf`` stage's config: every key with its type, default and
meaning, the keys docs/rlhf-pipeline.md documents (a test holds the page to it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.config.schema import (
    ActivationCheckpointConfig,
    CommConfig,
    LaunchConfig,
    MixedPrecisionConfig,
    OptimizerConfig,
    ParallelConfig,
    ZeroConfig,
)
from tessera.rlhf.dpo import DPOOptions
from tessera.rlhf.grpo import GRPOOptions
from tessera.rlhf.ppo import PPOOptions
from tessera.rlhf.reward import RewardOptions
from tessera.rlhf_pipeline.config import STAGES, ModelSpec

_OPTION_DOCS: dict[type, dict[str, str]] = {
    RewardOptions: {"center_rewards_coefficient": "Weight of mean((chosen + rejected)^2) added to the loss: keeps scores near 0."},
    DPOOptions: {
        "beta": "Strength of the KL constraint to the reference.",
        "loss_type": "'sigmoid' (DPO), 'hinge' (SLiC) or 'ipo'.",
        "label_smoothing": "cDPO's probability that a label is wrong (sigmoid only).",
        "reference_free": "Take the reference's log-probs as 0 (no reference model).",
    },
    PPOOptions: {
        "kl_coef": "The KL penalty's coefficient (the start value with kl_target).",
        "kl_target": "Adapt the coefficient towards this KL (Ziegler et al.); None: fixed.",
        "kl_horizon": "The adaptive controller's horizon.",
        "kl_estimator": "k1, abs, mse or k3.",
        "gamma": "GAE's discount.",
        "lam": "GAE's lambda.",
        "clip_eps": "The policy ratio's clip.",
        "clip_value": "The value's clip; None: none.",
        "clip_score": "Clip the scores to +-this; None: none.",
        "whiten_advantages": "Normalise advantages over the batch.",
        "epochs": "Passes over each rollout batch.",
        "minibatches": "Optimizer steps per pass.",
    },
    GRPOOptions: {
        "group_size": "Responses per prompt.",
        "beta": "The k3 KL term's weight (0: no reference model).",
        "clip_eps": "The ratio's clip.",
        "loss_type": "'grpo', 'bnpo' or 'dr_grpo' (how tokens are averaged).",
        "scale_rewards": "Divide advantages by the group's standard deviation (False: Dr. GRPO).",
        "epochs": "Passes over each batch of groups.",
        "minibatches": "Optimizer steps per pass.",
    },
}  # fmt: skip


def config_reference(stage: str) -> list[tuple[str, str, str, str]]:
    """Every key of ``stage``'s config: ``(key, type, default, meaning)`` rows (the tessera
    sections inside a model's layout are named, not expanded: docs/config.md has them)."""
    from tessera.config.loading import type_name

    rows: list[tuple[str, str, str, str]] = []
    tessera_sections = (ParallelConfig, ZeroConfig, MixedPrecisionConfig, ActivationCheckpointConfig, OptimizerConfig,
                        LaunchConfig, CommConfig)  # fmt: skip

    def walk(cls: Any, prefix: str) -> None:
        import typing

        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + ("from" if f.name == "from_" else f.name)
            tp = hints[f.name]
            doc = f.metadata.get("doc") or _OPTION_DOCS.get(cls, {}).get(f.name, "")
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(tp) and tp not in tessera_sections:
                rows.append((key, "section", "", doc))
                walk(tp, key + ".")
            elif tp == ModelSpec | None:
                rows.append((key, "section", "", doc))
                walk(ModelSpec, key + ".")
            elif dataclasses.is_dataclass(tp):
                rows.append((key, "section", "", doc + " (docs/config.md)"))
            else:
                rows.append((key, type_name(tp), repr(default), doc))

    walk(STAGES[stage], "")
    return rows
