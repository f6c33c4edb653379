"""What the HTTP server needs from whatever runs the model: the ``Backend`` protocol.

The server (``tessera.serve.app``) speaks text and OpenAI's JSON; a backend speaks token ids.
:class:`tessera.serve.ranks.RankBackend` is the real one: it starts the rank group that runs
``tessera.inference`` and talks to rank 0 over a local connection. Tests of the HTTP layer alone
may pass any object with these members.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessera.inference.params import SamplingParams

# A token's log-probability and its most likely alternatives ``((token, logprob), ...)``; a prompt
# token's entry also names the token: ``(token, logprob, alternatives)``.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]
PromptLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class Chunk:
    """New tokens of sequence ``index`` of one request. ``finish_reason`` is set on a sequence's
    last chunk: ``"stop"`` (a stop token), ``"length"`` (max_tokens or the context is full) or
    ``"abort"`` (cancelled, or the engine failed: ``error`` says why, for every sequence).
    ``logprobs``: one entry per token of ``token_ids`` when the request asked for them;
    ``prompt``: prompt tokens' log-probabilities (``echo``), on sequence 0's chunks."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt: tuple[PromptLogprob, ...] = ()
    stop_token: int | None = None  # the stop token that ended the sequence (not in token_ids; its
    # log-probability is the last of ``logprobs``, as vLLM reports it)


@dataclass(frozen=True)
class ModelInfo:
    """What the server tells clients about the model."""

    name: str
    max_model_len: int  # prompt plus generated tokens
    vocab_size: int
    adapters: tuple[str, ...] = ()  # the served LoRA adapters' names (a request's ``model`` picks one)
    extra: dict[str, Any] = field(default_factory=dict)


class Tokenizer(Protocol):
    """The part of a tokenizer the server uses (a ``transformers`` tokenizer has these; a
    byte-level model uses :class:`tessera.inference.text.ByteTokenizer`)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Backend(Protocol):
    """Runs requests. ``generate`` yields a request's chunks as they are made (each naming its
    sequence's ``index`` among ``params.n``), ending once every sequence has had a chunk with a
    ``finish_reason`` (or one chunk says ``"abort"``); leaving the iteration early (a client that went away)
    must free the request's KV blocks; ``adapter``: the name of one of ``info.adapters`` to run
    the request with (None: the base model alone). ``abort`` of a request that is unknown or
    already finished does nothing (the server may abort a request its iterator also cancels)."""

    info: ModelInfo
    tokenizer: Tokenizer

    def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[Chunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]:
        """Engine gauges for /metrics: ``running``, ``waiting`` (queue length), ``kv_blocks_used``,
        ``kv_blocks_total``."""
        ...

    async def close(self) -> None: ...
