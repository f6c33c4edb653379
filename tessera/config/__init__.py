"""Typed configuration: load a ``.py``, YAML, TOML or JSON file (or a dict), validate it, and
fail early with a message that names the key. See docs/config.md."""

from tessera.config.loading import (
    ConfigSource,
    apply_overrides,
    build,
    load_config,
    parallel_dims,
    read_config_file,
    require_available,
    unavailable_features,
)
from tessera.config.reference import reference_markdown, render_docs
from tessera.config.schema import (
    CommConfig,
    Config,
    DataConfig,
    GeminiConfig,
    LaunchConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PipelineConfig,
    ScheduleConfig,
    SequenceConfig,
    TensorConfig,
    TrainerConfig,
    ZeroConfig,
)

__all__ = [
    "CommConfig",
    "Config",
    "ScheduleConfig",
    "OptimizerConfig",
    "ModelConfig",
    "DataConfig",
    "ConfigSource",
    "GeminiConfig",
    "LaunchConfig",
    "MixedPrecisionConfig",
    "ParallelConfig",
    "PipelineConfig",
    "SequenceConfig",
    "TensorConfig",
    "TrainerConfig",
    "ZeroConfig",
    "apply_overrides",
    "build",
    "load_config",
    "parallel_dims",
    "read_config_file",
    "reference_markdown",
    "render_docs",
    "require_available",
    "unavailable_features",
]
