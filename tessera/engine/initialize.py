"""``initialize``: apply a layout to a model, optimizer, loss and data, choosing the training
strategy once.

This is the library form: it takes the context and the run's options explicitly. Users call
``tessera.initialize``, which finds the current context and builds the options from the
launched config (``tessera.session``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tessera.compiling import CompileReport, check_toolchain, compile_blocks, compile_loss
from tessera.context import ParallelContext
from tessera.context.placement import placement_of
from tessera.context.rules import Combination, check_combination
from tessera.engine.engine import Engine
from tessera.engine.options import TrainingOptions
from tessera.errors import ConfigError, NotAvailableError
from tessera.gemini import Gemini
from tessera.init.materialise import Source, capture, check_recording, loadable, materialise
from tessera.init.recording import recording_of
from tessera.memory.deferred import to_device
from tessera.memory.report import peak_rss_bytes
from tessera.nn.recompute import checkpoint_blocks
from tessera.parallel.data import AverageAtStep, DataParallel, distributed_loader
from tessera.parallel.experts import is_expert
from tessera.parallel.pipeline.partition import blocks_of
from tessera.parallel.pipeline.stage import PipelineStage
from tessera.parallel.pipeline.strategy import PipelineParallel
from tessera.parallel.strategy import Strategy
from tessera.zero import Zero


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: DataLoader | None = None,
    test_dataloader: DataLoader | None = None,
    lr_scheduler: Any = None,
    *,
    ctx: ParallelContext,
    options: TrainingOptions,
    init: Source = "random",
) -> tuple[Engine, DataLoader | None, DataLoader | None, Any]:
    """Return ``(engine, train_dataloader, test_dataloader, lr_scheduler)`` for ``ctx``'s layout.

    The model moves to the rank's device and is handed to the strategy the layout calls for;
    the data loaders are rebuilt so that each data-parallel rank reads its own samples (their
    ``batch_size`` stays the per-rank micro-batch). The optimizer must have been built over
    ``model``'s parameters; the scheduler is returned unchanged.

    A model built under ``tessera.deferred_init()`` is made here, only what this rank keeps,
    from ``init``: ``"random"`` (its recorded construction replayed: single-process values), a
    checkpoint folder or full-state ``.safetensors`` path, or ``fn(name, shape, dtype)``
    returning each tensor's full value. A model built normally is loaded from ``init`` when it
    names a path or a function.
    """
    model_params = {id(p) for p in model.parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
    if stray:
        raise ValueError(f"the optimizer holds {len(stray)} parameter(s) that are not the model's")
    rec = recording_of(itertools.chain(model.parameters(), model.buffers()))
    wants = []
    if rec is not None:
        check_recording(rec, model, init)
        wants = capture(model, rec)
        to_device(model, ctx.device)
    else:
        model.to(ctx.device)
    checkpoint_blocks(
        model, mode=options.recompute, every=options.recompute_every, ctx=ctx, for_compile=options.compile is not None
    )
    compiled = _compile(model, ctx, options)  # around the checkpoints: dynamo traces them
    if options.compile is not None and options.compile.loss and criterion is not None:
        criterion = compile_loss(criterion, options.compile)
    strategy = choose_strategy(model, optimizer, criterion, ctx, options)
    if rec is not None or not (isinstance(init, str) and init == "random"):
        if rec is None:
            wants = loadable(model)
        materialise(strategy, wants, rec, init, ctx.device)
    engine = Engine(strategy, criterion, ctx=ctx, options=options)
    engine.compile_report = compiled
    engine.lr_scheduler = lr_scheduler
    engine.init_peak_rss = peak_rss_bytes()  # the init phase's peak: process start to here
    data_group = ctx.group("data")
    if train_dataloader is not None:
        train_dataloader = distributed_loader(train_dataloader, data_group, options.seed)
    if test_dataloader is not None:
        test_dataloader = distributed_loader(test_dataloader, data_group, options.seed)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _compile(model: nn.Module, ctx: ParallelContext, options: TrainingOptions) -> CompileReport | None:
    """Compile the model's blocks (or its forward) per ``options.compile``, after checking that
    this machine can build the kernels; the report fills in as the regions first run."""
    if options.compile is None:
        return None
    if options.compile.scope == "model" and (
        ctx.size("pipeline") > 1
        or options.gemini is not None
        or (options.zero and options.zero.policy.release_parameters)
    ):
        raise ConfigError(
            "compile.scope='model' compiles the whole forward as one region, but pipeline stages run their layers "
            "one by one and ZeRO-3/Gemini gather parameters around each block; use compile.scope='blocks'"
        )
    check_toolchain(ctx.device, options.compile.backend)
    report = CompileReport()
    compile_blocks(model, options.compile, report)
    return report


def choose_strategy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None,
    ctx: ParallelContext,
    options: TrainingOptions,
) -> Strategy:
    """The one place that maps a layout to a strategy: pipeline stages (with a replicated or a
    ZeRO-1 optimizer), Gemini, ZeRO with its stage's policy, or DDP."""
    check_combination(combination_of(ctx, options))  # the layout rules, as the config checks them
    check_model_fits_layout(model, ctx)
    if ctx.size("pipeline") > 1:
        stage = _pipeline_stage(model, criterion, ctx, options)  # cut before ZeRO packs the chunks
        gradients: Strategy = (
            Zero(model, optimizer, ctx, options.zero)  # stage 1 only (the layout rules refuse 2 and 3 here)
            if options.zero is not None
            else AverageAtStep(model, optimizer, ctx)
        )
        return PipelineParallel(stage, gradients)
    if options.gemini is not None:
        return Gemini(model, optimizer, ctx, options.gemini)  # ZeRO-3 over tiers: reduces gradients itself
    if options.zero is not None:
        return Zero(model, optimizer, ctx, options.zero)  # reduces gradients itself: no DDP
    return DataParallel(model, optimizer, ctx)


def combination_of(ctx: ParallelContext, options: TrainingOptions) -> Combination:
    """``ctx``'s layout with the strategies ``options`` choose on it (ZeRO's stage and offload,
    Gemini, the pipeline's schedule), as the layout rules (``tessera.context.rules``) read them."""
    zero, pp = options.zero, options.pipeline
    return ctx.dims.combination()._replace(
        schedule=pp.schedule,
        microbatches=pp.microbatches if pp.microbatches is not None else ctx.dims.pipeline,
        chunks=pp.chunks,
        zero=zero.policy.stage if zero is not None else 0,
        offload=zero is not None and zero.offload != "none",
        gemini=options.gemini is not None,
        host_shard=(zero is not None and zero.shard == "host")
        or (options.gemini is not None and options.gemini.shard == "host"),
    )


def check_model_fits_layout(model: nn.Module, ctx: ParallelContext) -> None:
    """Raise ConfigError when ``ctx``'s tensor, expert or pipeline axis has more than one rank
    but ``model`` gives it nothing to split: the ranks of that axis would all compute the same
    thing (or, for experts, nothing would be spread), silently, instead of sharing the work."""
    name = type(model).__name__
    tensor = ctx.size("tensor")
    if tensor > 1 and not any(_split_along_tensor(p, ctx) for p in model.parameters()):
        raise ConfigError(
            f"parallel.tensor.size={tensor}: {name} has no layer split along the tensor axis, so its "
            f"{tensor} tensor ranks would all compute the same thing. Build the model from tessera.nn "
            "layers (tessera.nn.Linear, Embedding, LayerNorm, ..., as tessera.models does), or set "
            "parallel.tensor.size=1 and give the ranks to data parallelism (unmodified Hugging Face "
            "models are split by their policy in tessera.initialize: docs/hf.md)"
        )
    expert = ctx.size("expert")
    if expert > 1 and not any(is_expert(p) for p in model.parameters()):
        raise ConfigError(
            f"parallel.expert.size={expert}: {name} has no mixture-of-experts layer whose experts it could spread. "
            "Build its MoE layers with tessera.nn.MoE (tessera's GPT: model.options num_experts, or a *-moe preset; "
            "Hugging Face Mixtral is spread by its policy), or set parallel.expert.size=1"
        )
    pipeline = ctx.size("pipeline")
    if pipeline > 1 and not _has_pipeline_layers(model):
        raise ConfigError(
            f"parallel.pipeline.size={pipeline}: tessera cannot find the layers of {name} to cut into "
            f"{pipeline} stages. Give the model a pipeline_layers() method returning its layers in "
            "order from input to loss (as tessera.models does), make it an nn.Sequential, or keep its "
            "blocks in an nn.ModuleList named 'blocks', 'layers' or 'h'; or set parallel.pipeline.size=1 "
            "(unmodified Hugging Face models are not cut into stages yet)"
        )


def _split_along_tensor(param: torch.Tensor, ctx: ParallelContext) -> bool:
    """Whether a tensor-parallel layer split ``param`` along (a sub-axis of) the tensor axis."""
    placement = placement_of(param)
    dims = (placement.mesh or ctx).dims
    tensor = set(dims.varied_coordinates("tensor"))
    return any(tensor & set(dims.varied_coordinates(axis)) for axis in placement.split_axes)


def _has_pipeline_layers(model: nn.Module) -> bool:
    if callable(getattr(model, "pipeline_layers", None)):
        return True
    try:
        blocks_of(model)
    except TypeError:
        return False
    return True


def _pipeline_stage(
    model: nn.Module, criterion: Callable[..., torch.Tensor] | None, ctx: ParallelContext, options: TrainingOptions
) -> PipelineStage:
    """This rank's pipeline stage of ``model`` per ``options.pipeline``."""
    pp = options.pipeline
    if options.gradient_accumulation != 1:
        raise ConfigError(
            f"gradient_accumulation={options.gradient_accumulation} with pipeline stages: the pipeline's "
            "micro-batches are the accumulation; set parallel.pipeline.microbatches instead"
        )
    if options.precision == "fp16":
        raise NotAvailableError("fp16 loss scaling with pipeline stages is not available yet; use bf16 or fp32")
    return PipelineStage(
        model,
        criterion,
        ctx,
        schedule=pp.schedule,
        microbatches=pp.microbatches if pp.microbatches is not None else ctx.size("pipeline"),
        chunks_per_rank=pp.chunks,
        method=pp.partition,
        boundaries=list(pp.boundaries) if pp.boundaries is not None else None,
    )
