"""Pipeline stages for unmodified Hugging Face models.

A model laid out as a :class:`~tessera.hf.decoder.Layout` becomes the layers the partitioner
cuts: :class:`Entry` (everything of the body before its first layer: embeddings, position
tables, rotary embeddings), one :class:`Layer` per decoder or encoder layer, and :class:`Exit`
(what follows the last layer: the final norm, a pooler, the head and the loss); a head tied to
the embedding stays one parameter, whose gradient the pipeline sums over the stages that use it.

A Hugging Face layer takes more than the hidden states: the attention mask the model made from
the batch's mask, rotary position embeddings, position ids. Rather than knowing each family's
arithmetic for those (it changes between releases), every stage asks the model itself: it runs
the body's forward on the micro-batch's inputs (every pipeline rank draws the same micro-batches;
:func:`tessera.parallel.pipeline.inputs.current_inputs`) until its first layer is called, and
keeps what that layer is called with. Stage 0 does this once per micro-batch with the real
embeddings (its output is the captured hidden states); a later stage does it without gradients,
once per chunk and micro-batch, with each of the body's parts that hold parameters (the
embeddings, which another stage trains and a deferred model has not even allocated here) giving
zeros of the hidden states' shape instead. So only the hidden states cross the wire, and masks,
positions and padding reach every stage as the model computes them.

The last stage likewise leaves what follows the layers to the model: :class:`Exit` runs the
model's own forward with its body answering the received hidden states (after the final norm and
the pooler), so the head (a masked-LM transform, a classifier on the first token or the pooled
output) and the loss (with ``labels`` in the micro-batch) are exactly transformers'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tessera.hf.decoder import Layout, has_submodule
from tessera.parallel.pipeline.inputs import current_inputs

__all__ = ["Entry", "Exit", "Layer", "StageOutput", "pipeline_layers"]

LOSS_ONLY = ("labels",)  # batch entries the body does not take (the head's loss does)

#: ``fn(inputs) -> shape``: the leading dimensions (batch, tokens) of the hidden states entering
#: the first layer for a micro-batch's body inputs
EntryShape = Callable[[dict[str, Any]], tuple[int, ...]]


class StageOutput(dict):  # type: ignore[type-arg]
    """The last stage's output: the model's output fields (``logits``, or a base model's
    ``last_hidden_state`` and ``pooler_output``) and, when the batch has labels and the model
    computes a loss, ``loss``; readable as attributes or keys, like a ``transformers``
    ModelOutput."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _BodyOutput(dict):  # type: ignore[type-arg]
    """What the body answers to the model's forward in :class:`Exit`: fields by name (a missing
    one is None) or, as a ModelOutput's tuple of its set fields, by position."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return tuple(v for v in self.values() if v is not None)[key]


def _as_inputs(inputs: Any, main: str) -> dict[str, Any]:
    """A micro-batch's inputs as the body's keyword arguments: the model's main input (token ids,
    pixel values), or a dict of inputs."""
    if isinstance(inputs, torch.Tensor):
        return {main: inputs}
    if isinstance(inputs, dict):
        return {k: v for k, v in inputs.items() if k not in LOSS_ONLY}
    raise TypeError(
        f"a pipelined Hugging Face model takes its {main} or a dict of model inputs per micro-batch, got "
        f"{type(inputs).__name__}"
    )


def token_shape(inputs: dict[str, Any]) -> tuple[int, ...]:
    """The leading dimensions of a text model's hidden states: those of its token ids (or mask)."""
    for name in ("input_ids", "attention_mask", "inputs_embeds"):
        if inputs.get(name) is not None:
            return tuple(inputs[name].shape[:2])
    raise TypeError(f"cannot tell the batch's shape from the inputs {sorted(inputs)}")


class _Captured(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def _answering(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module``'s forward is ``forward`` inside the block (its hooks still run)."""
    object.__setattr__(module, "forward", forward)
    try:
        yield
    finally:
        object.__delattr__(module, "forward")


class Prologue:
    """Runs ``body``'s forward until ``first`` (its first layer) is called and returns what that
    layer was called with; remembers the last micro-batch's answer (its inputs object kept, so
    its id stays unique). ``parts`` are the body's modules before its first layer."""

    def __init__(
        self,
        body: nn.Module,
        first: nn.Module,
        parts: list[nn.Module],
        *,
        hidden_size: int,
        main_input: str,
        entry_shape: EntryShape,
    ) -> None:
        self.body, self.hidden_size, self.main_input, self.entry_shape = body, hidden_size, main_input, entry_shape
        self.weighted = [m for m in parts if any(True for _ in m.parameters())]
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
        args, kwargs = self._run(_as_inputs(raw, self.main_input))
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self._key, self._call = raw, (args[1:], kwargs)
        return hidden

    def layer_call(self, raw: Any, like: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments besides the hidden states each layer is called with for the micro-batch
        ``raw``; made without gradients, the parts with parameters giving zeros of ``like``'s
        dtype, unless kept."""
        if raw is self._key and self._call is not None:
            return self._call
        inputs = _as_inputs(raw, self.main_input)
        shape = (*self.entry_shape(inputs), self.hidden_size)

        def zeros(*_: Any, **__: Any) -> torch.Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        with torch.no_grad(), contextlib.ExitStack() as stack:
            for part in self.weighted:
                stack.enter_context(_answering(part, zeros))
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
    """The last layer: the body's final norm and pooler, then the rest of the model's forward
    (its head, and its loss with labels in the micro-batch's inputs) with the body answering
    those hidden states. ``parts``: the modules outside the body (the head), registered here so
    that the stage owns their parameters."""

    _model: nn.Module
    _body: nn.Module

    def __init__(
        self,
        model: nn.Module,
        body: nn.Module,
        norm: nn.Module | None,
        pooler: nn.Module | None,
        parts: list[nn.Module],
        main_input: str,
    ) -> None:
        super().__init__()
        self.norm, self.pooler = norm, pooler
        self.parts = nn.ModuleList(parts)
        self.main_input = main_input
        object.__setattr__(self, "_model", model)  # not a submodule: this stage owns only the above
        object.__setattr__(self, "_body", body)

    def forward(self, x: torch.Tensor) -> StageOutput:
        hidden = self.norm(x) if self.norm is not None else x
        answer = _BodyOutput(
            last_hidden_state=hidden, pooler_output=self.pooler(hidden) if self.pooler is not None else None
        )
        if self._model is self._body:  # a base model
            return StageOutput((k, v) for k, v in answer.items() if v is not None)
        raw = current_inputs()
        inputs = dict(raw) if isinstance(raw, dict) else {self.main_input: raw}
        with _answering(self._body, lambda *_, **__: answer):
            out = self._model(**inputs)
        return StageOutput((k, v) for k, v in out.items() if v is not None)


def pipeline_layers(model: Any, layout: Layout, entry_shape: EntryShape = token_shape) -> list[nn.Module]:
    """``model`` (laid out as ``layout``, already rewritten for tensor parallelism) as layers for
    pipeline stages: Entry, each layer, Exit. ``entry_shape`` gives the batch and token
    dimensions of the hidden states entering the first layer (default: the token ids')."""
    has_head = has_submodule(model, layout.head)
    body = model.get_submodule(layout.body) if has_head and layout.body else model
    layers = body.get_submodule(layout.layers)
    norm = body.get_submodule(layout.final_norm) if layout.final_norm is not None else None
    pooler = getattr(body, "pooler", None)
    later = {id(m) for tail in (layers, norm, pooler) if tail is not None for m in tail.modules()}
    parts = [m for m in body.children() if not any(id(sub) in later for sub in m.modules())]
    head = [m for m in model.children() if m is not body] if body is not model else []
    main = getattr(model, "main_input_name", "input_ids")
    prologue = Prologue(
        body, layers[0], parts, hidden_size=model.config.hidden_size, main_input=main, entry_shape=entry_shape
    )
    return [
        Entry(parts, prologue),
        *(Layer(layer, prologue) for layer in layers),
        Exit(model, body, norm, pooler, head, main),
    ]
