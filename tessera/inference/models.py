"""The models generation runs: this rank's part of a model laid out for inference, and one step
of it over a :class:`~tessera.inference.cache.StepBatch`.

:func:`prepare_model` lays a model out as training would (tensor-parallel layers for tessera's
GPT, a ``tessera.hf`` policy for a ``transformers`` model), cuts it into pipeline stages, and
fills only what this rank keeps (a model built under ``tessera.deferred_init()`` is never whole
on one rank) from a tessera checkpoint, a Hugging Face folder, or its own construction.

A :class:`Runner` runs a step on this rank's stage: the first stage embeds the step's tokens,
each stage runs its layers with attention over the paged KV cache, and the last one returns the
logits of each sequence's last new token over the whole vocabulary (gathered over the tensor
axis). tessera's GPT takes the cache through its blocks' ``attend`` argument; a ``transformers``
model through an attention function registered with transformers' ``AttentionInterface``
(``"tessera_paged"``), so the model's own code computes everything else (rotary embeddings,
norms, heads).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tessera.comm import all_gather
from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.hf import prepare as prepare_hf
from tessera.hf.apply import is_hf_model
from tessera.inference.adapters import install_adapters
from tessera.inference.cache import StepBatch, paged_attention
from tessera.inference.quantize import quantize_int8
from tessera.init.materialise import Source, capture, check_recording, loadable, materialise
from tessera.init.recording import continue_recording, recording_of
from tessera.lora.routing import AdapterRouting
from tessera.memory.deferred import to_device
from tessera.models.gpt import GPT
from tessera.parallel.pipeline.inputs import running_inputs
from tessera.parallel.pipeline.partition import chunk_ranges, partition
from tessera.parallel.strategy import Strategy

ATTENTION = "tessera_paged"


class Runner(Protocol):
    """One step of this rank's pipeline stage."""

    first: bool  # embeds the tokens
    last: bool  # returns logits
    hidden_size: int
    vocab_size: int
    max_len: int  # longest sequence (prompt and generated tokens) the model's positions cover
    dtype: torch.dtype  # of the hidden states sent between stages
    # (the runners of prepare_model also have ``routing``: their served adapters' AdapterRouting, or None)

    def forward(self, batch: StepBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """``hidden`` ``[S, T, hidden_size]`` from the previous stage (None on the first) ->
        this stage's output: hidden states for the next stage, or on the last stage the logits
        ``[S, vocab_size]`` (float32) of each sequence's last new token (``[K, vocab_size]`` at
        the batch's ``logit_index`` when it has one)."""
        ...


class _Holding(Strategy):
    """What this rank keeps of a model for inference: the parameters of its stage's layers (and
    every buffer), as a strategy that ``materialise`` fills; it never trains."""

    name = "inference"

    def __init__(self, model: nn.Module, kept: set[int], ctx: ParallelContext) -> None:
        self.module = self.model = model
        self.ctx = ctx
        self.optimizer = None
        self._kept = kept

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._kept


def _stage_range(layers: list[nn.Module], ctx: ParallelContext) -> tuple[int, int]:
    """The layers ``[start, end)`` of this rank's pipeline stage (cut by parameter counts)."""
    p = ctx.size("pipeline")
    if p == 1:
        return 0, len(layers)
    boundaries = partition(layers, p, "parameters")
    return chunk_ranges(boundaries, len(layers))[ctx.local_rank("pipeline")]


def prepare_model(
    model: nn.Module,
    ctx: ParallelContext,
    init: Source = "random",
    *,
    quantize: str | None = None,
    adapters: Sequence[str | Path] = (),
) -> Runner:
    """Lay ``model`` (tessera's GPT, built under ``ctx``, or a ``transformers`` causal LM) out for
    ``ctx``, fill this rank's part from ``init`` (``"random"``: a deferred model's recorded
    construction; a tessera checkpoint folder or full-state ``.safetensors`` file; for a model
    from ``tessera.hf.from_pretrained``, ``"random"`` reads its folder) and return its runner.
    ``quantize="int8"``: this rank's linear layers get int8 weights with per-channel scales
    (:func:`tessera.inference.quantize.quantize_int8`). ``adapters``: PEFT LoRA folders served
    over this one base (:func:`tessera.inference.adapters.install_adapters`), adapter ``i`` the
    folder ``adapters[i]``, chosen per sequence by :attr:`StepBatch.adapters`; under int8 the base
    is quantized and the adapters keep the model's dtype."""
    if quantize not in (None, "int8"):
        raise ConfigError(f"quantize={quantize!r}: tessera quantizes weights to 'int8' (or None: full precision)")
    if ctx.size("sequence") > 1 or ctx.size("data") > 1:
        raise ConfigError(
            "generation runs under tensor and pipeline parallelism: set parallel.sequence.size=1 and "
            "parallel.data.size=1 (serve more replicas as separate servers)"
        )
    if ctx.size("tensor") > 1 and ctx.dims.tensor_mode != "1d":
        raise ConfigError(
            f"generation with parallel.tensor.mode={ctx.dims.tensor_mode!r}: tessera generates under 1d "
            "tensor parallelism (the grid modes split the batch, which a decode step of one token per "
            "sequence cannot share); use mode='1d'"
        )
    if ctx.dims.sequence_parallel:
        raise ConfigError("generation with parallel.tensor.sequence_parallel=True: set it to False for inference")
    hf = is_hf_model(model)
    if not hf and not isinstance(model, GPT):
        raise ConfigError(
            f"tessera generates with its GPT and with transformers causal LMs (GPT-2, LLaMA family); got "
            f"{type(model).__name__}"
        )
    with continue_recording(model):
        prepare_hf(model, None, ctx)
    layers = _pipeline_layers(model, ctx)
    start, end = _stage_range(layers, ctx)
    kept = {id(p) for layer in layers[start:end] for p in layer.parameters()}
    _fill(model, _Holding(model, kept, ctx), ctx, init)
    model.eval()
    routing = install_adapters(model, adapters, ctx) if adapters else None
    if quantize == "int8":  # this stage's layers (another stage's weights were never made here)
        quantize_int8(model, skip=_not_made)
    runner: GPTRunner | HFRunner
    if hf:
        runner = HFRunner(model, layers[start:end], start == 0, end == len(layers), ctx)
    else:
        assert isinstance(model, GPT)
        runner = GPTRunner(model, start, end, ctx)
    runner.routing = routing
    return runner


def _not_made(_: str, module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return weight is not None and weight.is_meta


def _pipeline_layers(model: nn.Module, ctx: ParallelContext) -> list[nn.Module]:
    if ctx.size("pipeline") == 1:
        return [model]
    layers = model.pipeline_layers()  # type: ignore[operator]
    if len(layers) < ctx.size("pipeline"):
        raise ConfigError(
            f"parallel.pipeline.size={ctx.size('pipeline')}: the model has only {len(layers)} pipeline layers"
        )
    return list(layers)


def _fill(model: nn.Module, holding: _Holding, ctx: ParallelContext, init: Source) -> None:
    """Materialise what ``holding`` keeps of ``model`` (deferred or not) from ``init``."""
    rec = recording_of(itertools.chain(model.parameters(), model.buffers()))
    if rec is not None:
        check_recording(rec, model, init)
        wants = capture(model, rec)
        to_device(model, ctx.device)
        materialise(holding, wants, rec, init, ctx.device)
        return
    model.to(ctx.device)
    if not (isinstance(init, str) and init == "random"):
        materialise(holding, loadable(model), None, init, ctx.device)


def _gather_vocab(logits: torch.Tensor, vocab: int, ctx: ParallelContext) -> torch.Tensor:
    """This rank's vocabulary block of ``[S, V/P]`` logits -> ``[S, vocab]`` (padding cut)."""
    return all_gather(logits.contiguous(), ctx.group("tensor"), dim=-1)[..., :vocab]


class GPTRunner:
    """tessera's GPT: pipeline layers ``[embed, block 0 .. block n-1, head]``, this stage's
    ``[start, end)`` of them (the whole model without pipeline stages)."""

    def __init__(self, model: GPT, start: int, end: int, ctx: ParallelContext) -> None:
        cfg = model.config
        count = cfg.n_layers + 2
        if ctx.size("pipeline") == 1:
            start, end = 0, count
        self.model, self.ctx = model, ctx
        self.first, self.last = start == 0, end == count
        self.blocks = [(i, model.blocks[i]) for i in range(max(start - 1, 0), min(end - 1, cfg.n_layers))]
        self.hidden_size, self.vocab_size, self.max_len = cfg.d_model, cfg.vocab_size, cfg.max_seq_len
        self.dtype: torch.dtype = next(p for p in model.parameters() if not p.is_meta).dtype
        self.routing: AdapterRouting | None = None

    @torch.no_grad()
    def forward(self, batch: StepBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        _route(self.routing, batch)
        x = self.model.embed(batch.tokens, batch.positions) if self.first else hidden
        assert x is not None
        for index, block in self.blocks:
            x = block(x, attend=partial(_attend, index, batch))
        if not self.last:
            return x
        if batch.logit_index is None:
            logits = self.model.head(x[:, -1:])[:, 0]
        else:
            logits = self.model.head(x.reshape(-1, x.shape[-1]).index_select(0, batch.logit_index)[None])[0]
        return _gather_vocab(logits, self.vocab_size, self.ctx).float()


def _route(routing: AdapterRouting | None, batch: StepBatch) -> None:
    """Set the step's adapter per token for the routed layers (every token of a sequence uses
    the sequence's adapter; a batch that names none runs the base alone)."""
    if routing is None:
        return
    count, width = batch.tokens.shape
    routing.route(batch.adapters or (-1,) * count, width)


def _attend(layer: int, batch: StepBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return paged_attention(layer, q, k, v, batch)


class HFRunner:
    """A ``transformers`` causal LM: the whole model, or this stage's pipeline layers
    (``tessera.hf.stages``: Entry, decoder layers, Exit), with the ``"tessera_paged"``
    attention."""

    def __init__(
        self, model: nn.Module, layers: list[nn.Module], first: bool, last: bool, ctx: ParallelContext
    ) -> None:
        register_attention()
        config: Any = model.config
        config._attn_implementation = ATTENTION
        self.model, self.layers, self.ctx = model, layers, ctx
        self.first, self.last = first, last
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.max_len = int(getattr(config, "max_position_embeddings", None) or config.n_positions)
        self.dtype = next(p for p in model.parameters() if not p.is_meta).dtype
        self.routing: AdapterRouting | None = None

    @torch.no_grad()
    def forward(self, batch: StepBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        _route(self.routing, batch)
        inputs: dict[str, Any] = {
            "input_ids": batch.tokens,
            "position_ids": batch.positions,
            "paged": batch,
            "logits_to_keep": 1 if batch.logit_index is None else 0,
        }
        if self.layers == [self.model]:
            return self._picked(self.model(**inputs, use_cache=False).logits, batch)
        x: Any = inputs if self.first else hidden
        with running_inputs(inputs):
            for layer in self.layers:
                x = layer(x)
        if not self.last:
            return x
        return self._picked(x["logits"], batch)

    def _picked(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """``[S, T', V]`` -> the logits the batch asks for, ``[K, vocab]`` float32."""
        if batch.logit_index is None:
            return logits[:, -1, : self.vocab_size].float()
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.logit_index)
        return flat[:, : self.vocab_size].float()


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: StepBatch | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the paged cache: ``[S, H, T, D]`` in,
    ``[S, T, H, D]`` out."""
    if paged is None:
        raise RuntimeError(
            f"the {ATTENTION!r} attention runs inside tessera.inference steps only (it reads the step's KV cache)"
        )
    out = paged_attention(int(module.layer_idx), query, key, value, paged, scale=scaling)  # type: ignore[arg-type]
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register ``"tessera_paged"`` with transformers' ``AttentionInterface`` (a dict update:
    calling it again changes nothing)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _hf_attention)
