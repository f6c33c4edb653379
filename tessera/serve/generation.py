"""One generation request's life over a :class:`~tessera.serve.backend.Backend`, as text: the
validated :class:`Job`, and the :class:`Generation` that runs it, turns its tokens into text
(stop strings included) and counts them, and aborts it in the backend when it ends early. The
HTTP layer (``tessera.serve.app``) builds the responses around it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tessera.inference.params import SamplingParams
from tessera.inference.text import TextStream
from tessera.serve.backend import Backend, Chunk
from tessera.serve.metrics import ServerMetrics
from tessera.serve.responses import ChatShape, CompletionShape, usage


@dataclass
class Job:
    """One validated generation request, ready for the backend."""

    request_id: str
    endpoint: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    shape: CompletionShape | ChatShape  # builds the response bodies
    arrived: float  # time.monotonic() when the request came in
    adapter: str | None = None  # the served LoRA adapter the request's model names (None: the base)


class Generation:
    """One job's run through the backend, as text.

    :meth:`pieces` yields the new text as tokens arrive and sets ``finish_reason`` (``"stop"``,
    ``"length"``) or ``error``; :meth:`close` must follow, however the iteration ended: it
    aborts the request in the backend unless it finished there, and closes its iterator.
    """

    def __init__(self, backend: Backend, job: Job, metrics: ServerMetrics) -> None:
        self.job = job
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.completion_tokens = 0
        self._backend = backend
        self._metrics = metrics
        self._chunks: AsyncIterator[Chunk] | None = None  # set when the backend has the request
        self._settled = False  # the backend is done with the request (finished, failed, aborted)

    @property
    def ended(self) -> bool:
        """Whether the answer is complete: a finish reason or an error."""
        return self.finish_reason is not None or self.error is not None

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object for the tokens so far."""
        return usage(len(self.job.prompt_ids), self.completion_tokens)

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text in pieces (never empty ones), up to a stop string or the end."""
        job = self.job
        text = TextStream(self._backend.tokenizer, job.params.stop)
        self._chunks = self._backend.generate(job.request_id, job.prompt_ids, job.params, adapter=job.adapter)
        async for chunk in self._chunks:
            self._count(chunk.token_ids)
            piece = text.push(chunk.token_ids) if chunk.token_ids else ""
            if chunk.finish_reason is not None:
                piece += text.finish()
                self._settle(chunk)
            if text.stopped and self.error is None:
                self.finish_reason = "stop"
                if not self._settled:
                    await self._abort()  # the engine would go on to max_tokens otherwise
            if piece and self.error is None:
                yield piece
            if self.ended:
                return
        self._settled = True
        self.error = "the engine ended the request without a finish reason"

    def fail(self, message: str) -> None:
        """End the answer with an error (one that happened outside the backend's chunks)."""
        self.error = message

    async def close(self) -> None:
        """Abort the request in the backend if it is still there, and close its iterator.
        Shielded: it runs while the request's task is being cancelled (a client that left)."""
        import anyio

        with anyio.CancelScope(shield=True):
            if self._chunks is None:
                return  # the backend never had the request
            if not self._settled:
                await self._abort()
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _abort(self) -> None:
        self._settled = True
        await self._backend.abort(self.job.request_id)

    def _settle(self, chunk: Chunk) -> None:
        self._settled = True
        if chunk.error is not None or chunk.finish_reason == "abort":
            self.error = chunk.error or "the engine aborted the request"
        else:
            self.finish_reason = chunk.finish_reason

    def _count(self, token_ids: Sequence[int]) -> None:
        if token_ids and self.completion_tokens == 0:
            self._metrics.time_to_first_token.observe(time.monotonic() - self.job.arrived)
        self.completion_tokens += len(token_ids)
        self._metrics.generation_tokens.inc(len(token_ids))
