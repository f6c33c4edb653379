"""The model sections of a ``tessera rlhf`` stage's config: each model's architecture
(:class:`ModelSpec`), layout, starting weights, optimizer, LoRA adapters and ranks, and the
reward (a rule or a reward model); the stages' configs are :mod:`tessera.rlhf_pipeline.config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tessera.config import Config, load_config
from tessera.config.schema import (
    HF_PREFIX,
    ActivationCheckpointConfig,
    CommConfig,
    LaunchConfig,
    LoraConfig,
    MixedPrecisionConfig,
    OptimizerConfig,
    ParallelConfig,
    ZeroConfig,
)
from tessera.errors import ConfigError

SORTING = "sorting"  # data: the shipped sorting task; reward.rule: its rule


def _field(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _field_factory(factory: Any, doc: str) -> Any:
    return field(default_factory=factory, metadata={"doc": doc})


def _section(cls: Any, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


# ---- the config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str = _field("gpt", "'gpt': tessera's GPT; 'hf:PATH': a Hugging Face causal LM (a local folder).")
    preset: str = _field("tiny", "gpt: the size preset (tiny, small, gpt2, ...).")
    options: dict[str, Any] = _field_factory(
        dict, "Overrides of the preset's fields (e.g. vocab_size, max_seq_len, d_model, n_layers, dropout); for hf:, "
        "of its config.json fields."
    )  # fmt: skip

    @property
    def hf_path(self) -> str | None:
        return self.name[len(HF_PREFIX) :] if self.name.startswith(HF_PREFIX) else None

    def validate(self, path: str) -> None:
        if self.name != "gpt" and not (self.name.startswith(HF_PREFIX) and self.name[len(HF_PREFIX) :].strip()):
            raise ConfigError(f"{path}name={self.name!r}: give 'gpt' (tessera's GPT) or 'hf:PATH' (a local folder)")
        if self.name == "gpt":
            from tessera.models.gpt import preset_config

            try:
                preset_config(self.preset, **self.options)
            except ConfigError as exc:
                raise ConfigError(f"{path}preset/options: {exc}") from None

    def describe(self) -> str:
        if self.hf_path is not None:
            return self.name
        shown = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"gpt {self.preset}" + (f" ({shown})" if shown else "")


@dataclass(frozen=True)
class FrozenLayout:
    """The layout sections of a tessera config that a model the stage only reads takes."""

    parallel: ParallelConfig = _section(ParallelConfig, "Its parallel layout over its ranks (as in a tessera config).")
    zero: ZeroConfig = _section(ZeroConfig, "ZeRO sharding (stage 3: of its weights).")
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig, "Its compute dtype.")

    def validate(self, path: str) -> None:
        _check_parallel(self.parallel, path)

    def tessera_config(self, seed: int, launch: LaunchConfig, comm_config: CommConfig, path: str) -> Config:
        """The tessera config of this layout (``tessera.initialize`` reads it)."""
        keys = {f.name for f in dataclasses.fields(LayoutConfig)} & {f.name for f in dataclasses.fields(self)}
        data = {key: _plain(getattr(self, key)) for key in keys}
        data.update(seed=seed, launch=_plain(launch), comm=_plain(comm_config))
        try:
            return load_config(data)
        except ConfigError as exc:
            raise ConfigError(f"{path.rstrip('.')}: {exc}") from None


@dataclass(frozen=True)
class LayoutConfig(FrozenLayout):
    """The layout sections of a tessera config, for a model the stage trains."""

    activation_checkpoint: ActivationCheckpointConfig = _section(
        ActivationCheckpointConfig, "Activations recomputed in its backward pass."
    )
    gradient_accumulation: int = _field(1, "Micro-batches per optimizer step on each data rank.")
    clip_grad_norm: float | None = _field(None, "Clip its gradients to this global norm; None: no clipping.")

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.gradient_accumulation < 1:
            raise ConfigError(f"{path}gradient_accumulation={self.gradient_accumulation} must be at least 1")


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _check_parallel(parallel: ParallelConfig, path: str) -> None:
    """The layouts the alignment trainers take: no planner, no pipeline or sequence split."""
    if parallel.auto:
        raise ConfigError(f"{path}parallel.auto: tessera rlhf takes each model's layout as given; set the axes")
    if parallel.pipeline.size > 1:
        raise ConfigError(
            f"{path}parallel.pipeline.size={parallel.pipeline.size}: the alignment trainers run whole models on "
            "each rank of a data or tensor group; pipeline stages are not supported by them yet"
        )
    if parallel.sequence.size > 1:
        raise ConfigError(
            f"{path}parallel.sequence.size={parallel.sequence.size}: the alignment trainers need every token of a "
            "sequence on each rank; sequence parallelism is not supported by them yet"
        )


def _check_ranks(ranks: list[int] | None, path: str) -> None:
    if ranks is None:
        return
    if not ranks:
        raise ConfigError(f"{path}ranks=[]: give at least one rank (or leave it out: every rank)")
    if any(r < 0 for r in ranks) or list(ranks) != sorted(set(ranks)):
        raise ConfigError(f"{path}ranks={ranks}: give distinct ranks of the job (0, 1, ...) in ascending order")


@dataclass(frozen=True)
class TrainedConfig(LayoutConfig):
    """A model the stage trains: its layout, where its weights start and its optimizer."""

    init: str | None = _field(
        None,
        "Its starting weights: a stage's output folder (its model.safetensors and model.json) or a .safetensors "
        "file; None: seeded random weights of `model`.",
    )
    optimizer: OptimizerConfig = _section(OptimizerConfig, "Its optimizer (constant learning rate).")
    lora: LoraConfig = _section(
        LoraConfig,
        "LoRA adapters trained on its frozen weights (rank 0: none, the whole model trains; docs/lora.md); a policy's "
        "or actor's frozen base, adapters off, is then also the reference.",
    )

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.lora.quantize != "none" and self.parallel.tensor.size > 1:
            raise ConfigError(
                f"{path}lora.quantize={self.lora.quantize!r}: a quantized base cannot be split by tensor parallelism "
                "(its codes are blocks of the whole weight); give it data parallelism or ZeRO (parallel.tensor.size=1)"
            )


@dataclass(frozen=True)
class PlacedTrainedConfig(TrainedConfig):
    """A trained model of PPO or GRPO: also the ranks that hold it."""

    ranks: list[int] | None = _field(None, "The ranks of the job that hold it (ascending); None: every rank.")

    def validate(self, path: str) -> None:
        super().validate(path)
        _check_ranks(self.ranks, path)


@dataclass(frozen=True)
class FrozenConfig(FrozenLayout):
    """A model PPO or GRPO only reads: the reference."""

    init: str | None = _field(None, "Its weights (a stage folder or .safetensors); None: the actor's starting weights.")
    ranks: list[int] | None = _field(None, "The ranks that hold it (ascending); None: every rank.")

    def validate(self, path: str) -> None:
        super().validate(path)
        _check_ranks(self.ranks, path)


@dataclass(frozen=True)
class RewardConfig(FrozenLayout):
    """What scores PPO's and GRPO's responses: a rule, or a reward model the ``rm`` stage wrote
    (its layout: ``ranks``, ``parallel``, ``zero``, ``mixed_precision``)."""

    rule: str | None = _field(None, "'sorting': the sorting task's rule (tessera.rlhf.sorting_reward).")
    from_: str | None = _field(None, "An rm stage's output folder: its reward model, frozen.")
    ranks: list[int] | None = _field(None, "from: the ranks that hold the reward model; None: every rank.")
    missing_stop_penalty: float = _field(
        0.0,
        "Subtracted from the score of a response that does not end with a stop token (cut at "
        "generation.max_tokens): a reward model never saw such responses, and may score them high (TRL's "
        "missing_eos_penalty).",
    )

    def validate(self, path: str) -> None:
        if (self.rule is None) == (self.from_ is None):
            raise ConfigError(
                f"{path.rstrip('.')}: give one of {path}rule (a rule: 'sorting') or {path}from (an rm stage's folder)"
            )
        if self.rule is not None and self.rule != SORTING:
            raise ConfigError(f"{path}rule={self.rule!r} is not a known rule; rules: {SORTING!r}")
        placed = self.ranks is not None or any(
            getattr(self, f.name) != getattr(FrozenLayout(), f.name) for f in dataclasses.fields(FrozenLayout)
        )
        if self.rule is not None and placed:
            raise ConfigError(
                f"{path}ranks and the layout sections place a reward model (from); a rule runs on every rank"
            )
        super().validate(path)
        _check_ranks(self.ranks, path)
        if not self.missing_stop_penalty >= 0:
            raise ConfigError(f"{path}missing_stop_penalty={self.missing_stop_penalty} must be >= 0")


@dataclass(frozen=True)
class DPOReferenceConfig:
    init: str | None = _field(
        None, "The reference's weights; None: the policy's starting weights. It lives on the policy's ranks."
    )
