"""The config of a ``tessera rlhf`` stage: one frozen dataclass per stage, read from a file
with overrides and checked key by key (the package docstring: :mod:`tessera.rlhf_pipeline`);
the sections of its models are :mod:`tessera.rlhf_pipeline.sections`."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.config import apply_overrides, build, read_config_file
from tessera.config.schema import CommConfig, LaunchConfig
from tessera.errors import ConfigError
from tessera.inference.params import SamplingParams
from tessera.rlhf.dpo import DPOOptions
from tessera.rlhf.grpo import GRPOOptions
from tessera.rlhf.ppo import PPOOptions
from tessera.rlhf.reward import RewardOptions
from tessera.rlhf_pipeline.sections import (
    SORTING,
    DPOReferenceConfig,
    FrozenConfig,
    FrozenLayout,
    LayoutConfig,
    ModelSpec,
    PlacedTrainedConfig,
    RewardConfig,
    TrainedConfig,
    _field,
    _field_factory,
    _section,
)

WEIGHTS = "model.safetensors"
CARD = "model.json"

# ---- the stages' own sections -------------------------------------------------------------------


@dataclass(frozen=True)
class ExampleData:
    train: str = _field(
        SORTING,
        "Training examples: 'sorting' (the shipped task) or a JSONL file (SFT: prompt and response, or a preference "
        "file's prompt and chosen; RM, DPO: prompt, chosen, rejected).",
    )
    eval: str | None = _field(SORTING, "Held-out examples, as `train` ('sorting': the 100 held-out pairs); None: none.")
    max_len: int | None = _field(
        None, "Longest prompt + response in tokens (longer responses are cut); None: no limit."
    )
    max_prompt_len: int | None = _field(None, "Longest prompt (its last tokens are kept); None: no limit.")

    def validate(self, path: str) -> None:
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"{path}max_len={self.max_len} must be at least 2 (or None)")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ConfigError(f"{path}max_prompt_len={self.max_prompt_len} must be at least 1 (or None)")


@dataclass(frozen=True)
class PromptData:
    train: str = _field(SORTING, "Training prompts: 'sorting' or a JSONL file with a `prompt` field.")
    eval: str | None = _field(SORTING, "Held-out prompts, answered greedily at each evaluation; None: none.")
    max_prompt_len: int | None = _field(None, "Longest prompt (its last tokens are kept); None: no limit.")

    def validate(self, path: str) -> None:
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ConfigError(f"{path}max_prompt_len={self.max_prompt_len} must be at least 1 (or None)")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = _field(12, "Most tokens of a response (the stop token included).")
    temperature: float = _field(1.0, "Sampling temperature of the rollouts (evaluations are greedy).")
    top_k: int = _field(0, "Keep the k likeliest tokens; 0: all.")
    top_p: float = _field(1.0, "Nucleus sampling's probability mass; 1: all.")
    stop: list[str] = _field_factory(lambda: ["\n"], "Stop strings, each one token of the tokenizer.")
    stop_token_ids: list[int] = _field_factory(list, "Stop token ids (besides the tokenizer's EOS, always one).")

    def validate(self, path: str) -> None:
        try:
            self.sampling(())
        except ValueError as exc:  # SamplingParams names the field first: "max_tokens=0 must be ..."
            raise ConfigError(f"{path}{exc}") from None

    def sampling(self, stop_ids: Sequence[int], greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_token_ids=tuple(stop_ids),
        )


@dataclass(frozen=True)
class LoopConfig:
    steps: int | None = _field(
        None,
        "Optimizer steps (PPO, GRPO: iterations, each one rollout batch); None: `epochs` passes over the training "
        "examples or prompts.",
    )
    epochs: int = _field(1, "Passes over the training data when `steps` is None.")
    batch_size: int = _field(16, "Examples (SFT), pairs (RM, DPO) or prompts (PPO, GRPO) per step, over all ranks.")
    shuffle: bool = _field(True, "Shuffle the training data each epoch (seeded: the same on every rank).")
    log_every: int = _field(1, "Write a line to metrics.jsonl (and print one) every this many steps.")
    eval_every: int | None = _field(
        None, "Evaluate every this many steps; always before the first step and after the last."
    )
    eval_size: int | None = _field(None, "Held-out examples or prompts evaluated; None: all of them.")
    eval_batch_size: int = _field(50, "Held-out rows per forward on each rank.")

    def validate(self, path: str) -> None:
        for name in ("steps", "eval_every", "eval_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{path}{name}={value} must be at least 1 (or None)")
        for name in ("epochs", "batch_size", "log_every", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}{name}={getattr(self, name)} must be at least 1")


@dataclass(frozen=True)
class StageConfig:
    """What every stage has."""

    output_dir: str | None = _field(None, "The stage's folder; None: runs/<time>-rlhf-<stage>. --output-dir wins.")
    seed: int = _field(0, "Seeds the models' random weights, the data order and the rollouts.")
    model: ModelSpec | None = _field(
        None, "The architecture of models that do not start from a stage folder (default: gpt tiny)."
    )
    train: LoopConfig = _section(LoopConfig, "The training loop, logging and evaluation.")
    launch: LaunchConfig = _section(
        LaunchConfig, "Processes (launch.nproc_per_node; --nproc-per-node wins) and threads."
    )
    comm: CommConfig = _section(CommConfig, "The collectives' watchdog.")


@dataclass(frozen=True)
class SFTStageConfig(StageConfig):
    policy: TrainedConfig = _section(TrainedConfig, "The model trained on the demonstrations.")
    data: ExampleData = _section(ExampleData, "Demonstrations (prompt and response).")


@dataclass(frozen=True)
class RMStageConfig(StageConfig):
    reward_model: TrainedConfig = _section(TrainedConfig, "The reward model (init: the SFT folder, for its backbone).")
    data: ExampleData = _section(ExampleData, "Preference pairs.")
    rm: RewardOptions = _section(RewardOptions, "The reward model's loss (RewardOptions).")


@dataclass(frozen=True)
class DPOStageConfig(StageConfig):
    policy: TrainedConfig = _section(TrainedConfig, "The policy (init: the SFT folder).")
    reference: DPOReferenceConfig = _section(DPOReferenceConfig, "The frozen reference.")
    data: ExampleData = _section(ExampleData, "Preference pairs.")
    dpo: DPOOptions = _section(DPOOptions, "DPO's options (DPOOptions).")


@dataclass(frozen=True)
class _RLStageConfig(StageConfig):
    actor: PlacedTrainedConfig = _section(PlacedTrainedConfig, "The policy that generates and trains (init: SFT).")
    reference: FrozenConfig = _section(FrozenConfig, "The frozen reference of the KL term.")
    reward: RewardConfig = _section(RewardConfig, "What scores the responses: `rule` or `from`.")
    data: PromptData = _section(PromptData, "Prompts.")
    generation: GenerationConfig = _section(GenerationConfig, "How the actor samples its responses.")


@dataclass(frozen=True)
class PPOStageConfig(_RLStageConfig):
    critic: PlacedTrainedConfig = _section(
        PlacedTrainedConfig,
        "The value model (init: None takes the actor's starting weights for its backbone, head 0; an rm folder: "
        "the reward model whole).",
    )
    ppo: PPOOptions = _section(PPOOptions, "PPO's options (PPOOptions).")


@dataclass(frozen=True)
class GRPOStageConfig(_RLStageConfig):
    grpo: GRPOOptions = _section(GRPOOptions, "GRPO's options (GRPOOptions).")


STAGES: dict[str, type[StageConfig]] = {
    "sft": SFTStageConfig,
    "rm": RMStageConfig,
    "ppo": PPOStageConfig,
    "dpo": DPOStageConfig,
    "grpo": GRPOStageConfig,
}

# the trainers' option classes: their ValueErrors name the class; the config names the section
_OPTION_SECTIONS = {"PPOOptions": "ppo", "GRPOOptions": "grpo", "DPOOptions": "dpo", "RewardOptions": "rm"}


def _public(message: str) -> str:
    """A message as the config spells it: the reward section's ``from`` (a Python keyword, so
    ``from_`` in the dataclass)."""
    return message.replace("from_", "from")


def load_stage_config(
    stage: str, source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> StageConfig:
    """The validated config of ``stage`` (one of :data:`STAGES`) from a file (.yaml, .toml, .json,
    .py), a mapping or None (defaults), with ``--set`` overrides. Raises ConfigError naming the
    key for unknown keys, wrong types and values out of range. What depends on the world size
    and the file system is checked by :func:`plan_stage`."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = json.loads(json.dumps(dict(source)))
    else:
        data = read_config_file(source)
    if overrides:
        data = apply_overrides(data, overrides)
    reward = data.get("reward")
    if isinstance(reward, Mapping) and "from" in reward:
        data["reward"] = {("from_" if k == "from" else k): v for k, v in reward.items()}
    model = data.pop("model", None)
    try:
        cfg: StageConfig = build(STAGES[stage], data)
        if model is not None:
            cfg = dataclasses.replace(cfg, model=build(ModelSpec, model, "model."))
    except ConfigError as exc:
        raise ConfigError(_public(str(exc))) from None
    except ValueError as exc:  # a trainer's options refused a value: name the section
        message = str(exc)
        for cls, section in _OPTION_SECTIONS.items():
            message = message.replace(f"{cls}: ", f"{section}: ")
        raise ConfigError(message) from None
    if isinstance(cfg, _RLStageConfig):
        cfg.reward.validate("reward.")  # also when the section is left out: a reward must be named
    if isinstance(cfg, GRPOStageConfig) and cfg.generation.temperature == 0:
        raise ConfigError(
            "generation.temperature=0: GRPO compares sampled responses of a group; give a temperature > 0"
        )
    return cfg


def default_run_dir(stage: str, cfg: StageConfig) -> Path:
    """The stage's folder: ``output_dir``, else ``runs/<time>-rlhf-<stage>``."""
    if cfg.output_dir is not None:
        return Path(cfg.output_dir)
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-rlhf-{stage}"


__all__ = [
    "CARD",
    "DPOReferenceConfig",
    "DPOStageConfig",
    "ExampleData",
    "FrozenConfig",
    "FrozenLayout",
    "GRPOStageConfig",
    "GenerationConfig",
    "LayoutConfig",
    "LoopConfig",
    "ModelSpec",
    "PPOStageConfig",
    "PlacedTrainedConfig",
    "PromptData",
    "RMStageConfig",
    "RewardConfig",
    "SFTStageConfig",
    "SORTING",
    "STAGES",
    "StageConfig",
    "TrainedConfig",
    "WEIGHTS",
    "default_run_dir",
    "load_stage_config",
]
