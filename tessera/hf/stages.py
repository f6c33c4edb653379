"""Pipeline stages for unmodified Hugging Face models.

A model laid out as a :class:`~tessera.hf.decoder.Layout` becomes the layers the partitioner
cuts: :class:`Entry` (everything of the body before its first layer: embeddings, position
tables, rotary embeddings), one :class:`Layer` per decoder or encoder layer, and :class:`Exit`
(the final norm and the head); a head tied to the embedding stays one parameter, whose gradient
the pipeline sums over the stages that use it.

A Hugging Face layer takes more than the hidden states: the attention mask the model made from
the batch's mask, rotary position embeddings, position ids. Rather than knowing each family's
arithmetic for those (it changes between releases), every stage asks the model itself: it runs
the body's forward on the micro-batch's inputs (every pipeline rank draws the same micro-batches;
:func:`tessera.parallel.pipeline.inputs.current_inputs`) until its first layer is called, and
keeps what that layer is called with. Stage 0 does this once per micro-batch with the real
embeddings (its output is the captured hidden states); a later stage does it without gradients
from a zero placeholder for the embeddings (``inputs_embeds``), once per chunk and micro-batch.
So only the hidden states cross the wire, and masks, positions and padding reach every stage
as the model computes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.hf.decoder import Layout, has_submodule
from tessera.parallel.pipeline.inputs import current_inputs

__all__ = ["Entry", "Exit", "Layer", "StageOutput", "pipeline_layers"]

LOSS_ONLY = ("labels",)  # batch entries the body does not take (the head's loss does)


class StageOutput(dict):  # type: ignore[type-arg]
    """The last stage's output: ``logits`` (or a base model's ``last_hidden_state``) and, when the
    batch has labels and the model a loss function, ``loss``; readable as attributes or keys,
    like a ``transformers`` ModelOutput."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_inputs(inputs: Any) -> dict[str, Any]:
    """A micro-batch's inputs as the body's keyword arguments: token ids, or a dict of them."""
    if isinstance(inputs, torch.Tensor):
        return {"input_ids": inputs}
    if isinstance(inputs, dict):
        return {k: v for k, v in inputs.items() if k not in LOSS_ONLY}
    raise TypeError(
        f"a pipelined Hugging Face model takes token ids or a dict of model inputs per micro-batch, got "
        f"{type(inputs).__name__}"
    )


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class Prologue:
    """Runs ``body``'s forward until ``first`` (its first layer) is called and returns what that
    layer was called with; remembers the last micro-batch's answer (its inputs object kept, so
    its id stays unique)."""

    def __init__(self, body: nn.Module, first: nn.Module, hidden_size: int) -> None:
        self.body, self.hidden_size = body, hidden_size
        self.armed = False
        self._key: Any = None
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        first.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)  # before any split

    def _hook(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.armed:
            raise _Captured(args, kwargs)

    def _run(self, inputs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.armed = True
        try:
            self.body(**inputs, use_cache=False)
        except _Captured as captured:
            return captured.args, captured.kwargs
        finally:
            self.armed = False
        raise RuntimeError(f"{type(self.body).__name__}'s forward never called its first layer")

    def enter(self, raw: Any) -> torch.Tensor:
        """Stage 0: the hidden states entering the first layer (with their graph back to the
        embeddings); the layers' other arguments are kept for this micro-batch."""
        args, kwargs = self._run(_as_inputs(raw))
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self._key, self._call = raw, (args[1:], kwargs)
        return hidden

    def layer_call(self, raw: Any, like: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments besides the hidden states each layer is called with for the micro-batch
        ``raw``; made without gradients from a placeholder of ``like``'s dtype unless kept."""
        if raw is self._key and self._call is not None:
            return self._call
        inputs = _as_inputs(raw)
        ids = inputs.pop("input_ids", None)
        shape = tuple(ids.shape) if ids is not None else tuple(inputs["attention_mask"].shape)
        inputs["inputs_embeds"] = torch.zeros(*shape, self.hidden_size, dtype=like.dtype, device=like.device)
        with torch.no_grad():
            args, kwargs = self._run(inputs)
        kwargs.pop("hidden_states", None)
        self._key, self._call = raw, (args[1:], kwargs)
        return self._call


class Entry(nn.Module):
    """Stage 0's first layer: the body's forward up to its first layer (``parts``: the modules it
    uses, registered here so that the stage owns their parameters)."""

    def __init__(self, parts: list[nn.Module], prologue: Prologue) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.prologue = prologue

    def forward(self, inputs: Any) -> torch.Tensor:
        return self.prologue.enter(inputs)


class Layer(nn.Module):
    """One of the model's layers, called with the hidden states it receives and the other
    arguments the model calls it with for the current micro-batch."""

    def __init__(self, layer: nn.Module, prologue: Prologue) -> None:
        super().__init__()
        self.layer = layer
        self.prologue = prologue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.prologue.layer_call(current_inputs(), x)
        out = self.layer(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class Exit(nn.Module):
    """The last layer: the final norm and the head (a base model: the norm alone); with labels in
    the micro-batch's inputs and a model loss function, the model's loss too."""

    def __init__(self, model: Any, norm: nn.Module | None, head: nn.Module | None) -> None:
        super().__init__()
        self.norm, self.head = norm, head
        self._loss = getattr(model, "loss_function", None) if head is not None else None
        self._vocab = getattr(model.config, "vocab_size", None)

    def forward(self, x: torch.Tensor) -> StageOutput:
        hidden = self.norm(x) if self.norm is not None else x
        if self.head is None:
            return StageOutput(last_hidden_state=hidden)
        out = StageOutput(logits=self.head(hidden))
        raw = current_inputs()
        if isinstance(raw, dict) and raw.get("labels") is not None and self._loss is not None:
            out["loss"] = self._loss(logits=out["logits"], labels=raw["labels"], vocab_size=self._vocab)
        return out


def pipeline_layers(model: Any, layout: Layout) -> list[nn.Module]:
    """``model`` (laid out as ``layout``, already rewritten for tensor parallelism) as layers for
    pipeline stages: Entry, each layer, Exit."""
    has_head = has_submodule(model, layout.head)
    body = model.get_submodule(layout.body) if has_head and layout.body else model
    layers = body.get_submodule(layout.layers)
    norm = body.get_submodule(layout.final_norm) if layout.final_norm is not None else None
    prologue = Prologue(body, layers[0], model.config.hidden_size)
    later = {id(layers), id(norm)}
    parts = [m for m in body.children() if id(m) not in later]
    head = model.get_submodule(layout.head) if has_head else None
    return [Entry(parts, prologue), *(Layer(layer, prologue) for layer in layers), Exit(model, norm, head)]
