"""``parallel = "auto"``: the planner chooses the layout when the world size is known.

:func:`resolve_auto` plans the configured model (``model.preset`` or an ``hf:`` path) for the
config's step (``data.micro_batch_size`` x ranks x ``gradient_accumulation`` samples of
``data.seq_len`` tokens, ``mixed_precision.dtype``, the optimizer) on ``world_size`` ranks of this
machine's memory (``planner.device_memory``, else a GPU's memory or the host's shared by the node's
ranks) and returns the config with the chosen layout written in: ``parallel``, ``zero``,
``activation_checkpoint``, ``gradient_accumulation`` and ``data.micro_batch_size``, the global
batch unchanged. Every rank computes the same plan from the same inputs; nothing is measured
unless ``planner.calibrate`` asks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from tessera.config.loading import load_config
from tessera.config.schema import Config, parse_bytes
from tessera.errors import ConfigError

CPU_MEMORY_SHARE = 0.8  # of the host's memory, shared by this node's ranks (the rest: OS, page cache)


def model_spec(config: Config) -> Any:
    """The planner's :class:`~tessera.planner.spec.ModelSpec` of ``config.model`` at ``data.seq_len``,
    with the ``lora`` section's adapters."""
    from tessera.planner.adapters import Adapters
    from tessera.planner.spec import from_gpt_preset, from_hf_config

    seq_len = config.data.seq_len
    hf_path = config.model.hf_path
    adapters = Adapters.from_config(config.lora)  # LoRA: adapters train, the base is frozen
    if hf_path is None:
        return dataclasses.replace(
            from_gpt_preset(config.model.preset, seq_len, **config.model.options), adapters=adapters
        )
    spec = from_hf_config(hf_path, seq_len)
    # tessera train reads at most 1024 tokens of an hf: model unless data.seq_len says (DataConfig)
    return dataclasses.replace(spec, seq_len=spec.seq_len if seq_len else min(spec.seq_len, 1024), adapters=adapters)


def workload_of(config: Config, world_size: int) -> Any:
    """The step ``config`` implies on ``world_size`` ranks: its global batch is what pure data
    parallelism would run (``micro_batch_size x world_size x gradient_accumulation``)."""
    from tessera.planner.spec import Workload

    batch = config.data.micro_batch_size * world_size * config.gradient_accumulation
    return Workload(global_batch=batch, seq_len=config.data.seq_len, dtype=config.mixed_precision.dtype,
                    optimizer=config.optimizer.name)  # fmt: skip


def machine_memory(local_world_size: int, cuda: bool) -> int:
    """Bytes one rank may plan for on this machine: a GPU's memory less 2 GiB, or a share of the
    host's memory (:data:`CPU_MEMORY_SHARE`) split over the node's ranks."""
    if cuda:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory) - 2 * 2**30
    from tessera.planner.calibrate import host_memory_bytes

    return int(host_memory_bytes() * CPU_MEMORY_SHARE) // max(1, local_world_size)


def on_cuda(config: Config) -> bool:
    """Whether the ranks will run on GPUs (as ``tessera.launch`` decides)."""
    import torch

    return torch.cuda.is_available() and config.launch.backend != "gloo"


def cluster_of(config: Config, world_size: int, local_world_size: int, cuda: bool) -> Any:
    """The cluster to plan for: ``planner.hardware``'s figures (default by device kind) or this
    machine's calibration, ``local_world_size`` ranks a node, the memory per rank."""
    from tessera.planner.scenarios import HARDWARE

    memory = parse_bytes(config.planner.device_memory, "planner.device_memory") or machine_memory(
        local_world_size, cuda
    )
    per_node = local_world_size if world_size % local_world_size == 0 else world_size
    if config.planner.calibrate:  # measuring needs ranks of its own, which a launched run is already
        raise ConfigError(
            "planner.calibrate=true at launch is not available yet: run `tessera plan --calibrate --out best.py` "
            "and train with the config it writes"
        )
    hardware = HARDWARE[config.planner.hardware or ("a100-80gb" if cuda else "cpu")]
    dtype = config.mixed_precision.dtype
    return hardware.cluster(world_size, dtype=dtype, device_memory=memory, devices_per_node=per_node)


def apply_layout(config: Config, layout: Any) -> Config:
    """``config`` with ``layout`` (a :class:`~tessera.planner.layout.Layout`) written in."""
    data = dataclasses.asdict(config)
    chosen = layout.to_config()
    data["parallel"] = chosen["parallel"]
    data["gradient_accumulation"] = chosen["gradient_accumulation"]
    data["data"]["micro_batch_size"] = layout.micro_batch
    data["zero"].update(stage=layout.zero, offload_optimizer="cpu" if layout.offload else "none")
    data["activation_checkpoint"]["mode"] = layout.checkpoint
    return load_config(data)


def resolve_auto(
    config: Config,
    world_size: int,
    *,
    local_world_size: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> Config:
    """``config`` with ``parallel = "auto"`` replaced by the planner's layout for ``world_size``
    ranks (``local_world_size`` of them on a node; default: LOCAL_WORLD_SIZE, else all);
    ``config`` itself when it names its layout. ``announce`` gets one or two lines: the layout
    chosen and why. ConfigError when no layout fits, saying by how much the nearest misses."""
    if not config.parallel.auto:
        return config
    from tessera.planner.search import Limits, plan

    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cuda = on_cuda(config)
    cluster = cluster_of(config, world_size, local, cuda)
    # on CPU the device is the host: offloading the optimizer there saves nothing
    result = plan(model_spec(config), cluster, workload_of(config, world_size), limits=Limits(offload=cuda))
    try:
        best = result.best
    except ConfigError as exc:
        raise ConfigError(f'parallel="auto": {exc}') from None
    if announce is not None:
        announce(f'tessera: parallel="auto" on {world_size} ranks chose ' + result.summary())
    return apply_layout(config, best.layout)


def resolve_batch(config: Config, data_ranks: int) -> Config:
    """``config`` with ``gradient_accumulation`` (with a pipeline: ``parallel.pipeline.microbatches``)
    chosen so that a step takes ``data.global_batch_size`` samples over ``data_ranks`` ranks of
    ``data.micro_batch_size`` each; ``config`` itself when no global batch is set. ConfigError
    when the global batch is not a whole number of micro-batches of all data ranks, or when the
    config also names another count of micro-batches."""
    wanted = config.data.global_batch_size
    if wanted is None:
        return config
    micro = config.data.micro_batch_size
    per_step, rest = divmod(wanted, micro * data_ranks)
    if rest or per_step < 1:
        raise ConfigError(
            f"data.global_batch_size={wanted} is not a whole number of micro-batches of data.micro_batch_size="
            f"{micro} on {data_ranks} data rank(s) ({micro * data_ranks} samples each): choose a global batch that "
            f"{micro * data_ranks} divides, or another micro_batch_size"
        )
    pipeline = config.parallel.pipeline
    if pipeline.size > 1:
        if pipeline.microbatches not in (None, per_step):
            raise ConfigError(
                f"data.global_batch_size={wanted} takes {per_step} micro-batches a step on {data_ranks} data rank(s), "
                f"and parallel.pipeline.microbatches={pipeline.microbatches} names another number: set one of them"
            )
        return dataclasses.replace(
            config, parallel=dataclasses.replace(
                config.parallel, pipeline=dataclasses.replace(pipeline, microbatches=per_step)))  # fmt: skip
    if config.gradient_accumulation not in (1, per_step):
        raise ConfigError(
            f"data.global_batch_size={wanted} takes {per_step} micro-batches a step on {data_ranks} data rank(s), "
            f"and gradient_accumulation={config.gradient_accumulation} names another number: set one of them"
        )
    return dataclasses.replace(config, gradient_accumulation=per_step)
