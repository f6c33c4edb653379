"""The top layer's translation of a config into the small typed options the layers below take
(they never read the config itself)."""

from __future__ import annotations

from tessera.compiling.options import CompileOptions
from tessera.config.schema import Config, parse_bytes
from tessera.engine.options import LossScaleOptions, TrainingOptions
from tessera.gemini.options import GeminiOptions
from tessera.parallel.pipeline.stage import PipelineOptions
from tessera.zero.policy import ZeroOptions, ZeroPolicy


def training_options(config: Config) -> TrainingOptions:
    """What ``initialize`` and the engine need of ``config``."""
    mp = config.mixed_precision
    loss_scale = None
    if mp.dtype == "fp16":
        dynamic = mp.loss_scale == "dynamic"
        loss_scale = LossScaleOptions(
            initial_scale=mp.initial_scale if dynamic else float(mp.loss_scale),
            dynamic=dynamic,
            growth_interval=mp.growth_interval,
            growth_factor=mp.growth_factor,
            backoff_factor=mp.backoff_factor,
            min_scale=mp.min_scale,
        )
    z = config.zero
    zero = (
        ZeroOptions(
            policy=ZeroPolicy.for_stage(z.stage),
            precision=mp.dtype,
            chunk_mb=z.chunk_mb,
            overlap_comm=z.overlap_comm,
            offload=z.offload_optimizer,
            shard=z.shard,
        )
        if z.stage > 0
        else None
    )
    g = config.gemini
    gemini = (
        GeminiOptions(
            placement=g.placement,
            device_budget=parse_bytes(g.device_budget, "gemini.device_budget"),
            host_budget=parse_bytes(g.host_budget, "gemini.host_budget"),
            offload_dir=g.offload_dir,
            chunk_mb=g.chunk_mb,
            params_offload=g.params_offload,
            optimizer_offload=g.optimizer_offload,
            precision=mp.dtype,
            map_large_buffers=g.map_large_buffers,
            frozen_tier=g.frozen_tier,
            shard=z.shard,
        )
        if g.active
        else None
    )
    pp = config.parallel.pipeline
    pipeline = PipelineOptions(
        schedule=pp.schedule,
        microbatches=pp.microbatches,
        chunks=pp.chunks,
        partition=pp.partition,
        boundaries=tuple(pp.boundaries) if pp.boundaries is not None else None,
    )
    return TrainingOptions(
        precision=mp.dtype,
        loss_scale=loss_scale,
        gradient_accumulation=config.gradient_accumulation,
        clip_grad_norm=config.clip_grad_norm,
        zero=zero,
        gemini=gemini,
        pipeline=pipeline,
        seed=config.seed,
        recompute=config.activation_checkpoint.mode,
        recompute_every=config.activation_checkpoint.every,
        compile=compile_options(config),
    )


def compile_options(config: Config) -> CompileOptions | None:
    """The run's compile settings (None: eager)."""
    c = config.compile
    if not c.enabled:
        return None
    return CompileOptions(
        scope=c.scope, backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic, loss=c.loss
    )
