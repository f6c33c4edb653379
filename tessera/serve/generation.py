"""One generation request's life over a :class:`~tessera.serve.backend.Backend`, as text: the
validated :class:`Job` (one or more prompts, ``n`` choices each), and the :class:`Generation`
that runs one prompt, turns each of its sequences' tokens into text (stop strings included) and
log-probabilities, counts them, and aborts the request in the backend when it ends early. The
HTTP layer (``tessera.serve.app``) builds the responses around it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tessera.inference.params import SamplingParams
from tessera.inference.text import TextStream
from tessera.serve.backend import Backend, Chunk, Tokenizer
from tessera.serve.metrics import ServerMetrics
from tessera.serve.responses import ChatShape, ChoiceAnswer, CompletionShape, LogprobEntry, usage


@dataclass
class Job:
    """One validated generation request, ready for the backend: its prompts (each answered by
    ``params.n`` choices, numbered prompt by prompt), whether the answer starts with the prompt
    (``echo``) and reports log-probabilities."""

    request_id: str
    endpoint: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    shape: CompletionShape | ChatShape  # builds the response bodies
    arrived: float  # time.monotonic() when the request came in
    adapter: str | None = None  # the served LoRA adapter the request's model names (None: the base)
    echo: bool = False
    logprobs: bool = False  # report each generated token's log-probability (and params.logprobs alternatives)
    prompt_texts: list[str] = field(default_factory=list)  # the prompts as text, for echo

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt (a request of one prompt has only it)."""
        return self.prompts[0]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass(frozen=True)
class Event:
    """News of one choice: new ``text``, the log-probability entries of the tokens it came with
    (None when none are reported), and ``start``: where that text begins in the choice's."""

    index: int
    text: str
    entries: list[LogprobEntry] | None = None
    start: int = 0


class _Choice:
    """One sequence's text and log-probabilities as its tokens arrive."""

    def __init__(self, index: int, tokenizer: Tokenizer, params: SamplingParams, job: Job, prompt: int) -> None:
        self.stream = TextStream(tokenizer, params.stop)
        self.answer = ChoiceAnswer(index, logprobs=[] if job.logprobs else None)
        self.echo = job.prompt_texts[prompt] if job.echo else ""
        self.answer.text = self.echo
        self.answer.offset = len(self.echo)
        self.settled = False  # the backend is done with this sequence
        self.tokens = 0  # generated tokens received
        self.entry_chars = 0  # text covered by the log-probability entries so far

    @property
    def ended(self) -> bool:
        return self.answer.finish_reason is not None


class Generation:
    """One prompt's run through the backend, its ``n`` sequences as choices (``first`` is the
    number of the first; a request of several prompts has a Generation per prompt).

    :meth:`events` yields each choice's new text as tokens arrive and sets each ``finish_reason``
    (``"stop"``, ``"length"``) or ``error``; :meth:`close` must follow, however the iteration
    ended: it aborts the request in the backend unless every sequence finished there, and
    closes its iterator."""

    def __init__(self, backend: Backend, job: Job, metrics: ServerMetrics, prompt: int = 0) -> None:
        self.job = job
        self.prompt = prompt
        self.request_id = job.request_id if len(job.prompts) == 1 else f"{job.request_id}-{prompt}"
        self.error: str | None = None
        first = prompt * job.params.n
        self.choices = [_Choice(first + j, backend.tokenizer, job.params, job, prompt) for j in range(job.params.n)]
        self._backend = backend
        self._metrics = metrics
        self._chunks: AsyncIterator[Chunk] | None = None  # set when the backend has the request
        self._settled = False  # the backend is done with the request (finished, failed, aborted)

    @property
    def ended(self) -> bool:
        """Whether the answer is complete: every choice has a finish reason, or an error came."""
        return self.error is not None or all(c.ended for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def answers(self) -> list[ChoiceAnswer]:
        return [c.answer for c in self.choices]

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object for this prompt's tokens so far."""
        return usage(len(self.job.prompts[self.prompt]), self.completion_tokens)

    async def events(self) -> AsyncIterator[Event]:
        """Each choice's text in pieces, up to a stop string or the end (with the echoed prompt
        first, and the log-probabilities when asked)."""
        job = self.job
        prompt_ids = job.prompts[self.prompt]
        if job.echo:  # the prompt's text opens each choice; its first token has no logprob
            for choice in self.choices:
                yield self._event(choice, choice.echo, [(prompt_ids[0], None, ())])
        self._chunks = self._backend.generate(self.request_id, prompt_ids, job.params, adapter=job.adapter)
        async for chunk in self._chunks:
            if chunk.error is not None or chunk.finish_reason == "abort":
                self._settled = True
                self.error = chunk.error or "the engine aborted the request"
                return
            for event in self._take(chunk):
                yield event
            if all(c.settled or c.ended for c in self.choices):
                if not all(c.settled for c in self.choices):
                    await self._abort()  # stop strings ended the rest: the engine would go on
                self._settled = True
                return
        self._settled = True
        if not self.ended:
            self.error = "the engine ended the request without a finish reason"

    def _event(self, choice: _Choice, text: str, entries: Sequence[LogprobEntry]) -> Event:
        """``text`` added to ``choice``, with ``entries`` when it reports log-probabilities."""
        if choice.answer.logprobs is None:
            return Event(choice.answer.index, text)
        start = choice.entry_chars
        entries = list(entries)
        choice.answer.logprobs += entries
        choice.entry_chars += sum(len(self._piece(t)) for t, _, _ in entries)
        return Event(choice.answer.index, text, entries, start)

    def _piece(self, token: int) -> str:
        return self._backend.tokenizer.decode([token])

    def _take(self, chunk: Chunk) -> list[Event]:
        events: list[Event] = []
        if chunk.prompt and self.job.echo:  # the prompt's log-probabilities, for every choice
            for choice in self.choices:
                if choice.answer.logprobs is not None:
                    events.append(self._event(choice, "", [(t, lp, top) for t, lp, top in chunk.prompt]))
        choice = self.choices[chunk.index]
        if choice.ended:  # a stop string ended it: what the engine still sends is dropped
            choice.settled = choice.settled or chunk.finish_reason is not None
            return events
        self._count(choice, chunk.token_ids)
        if chunk.stop_token is not None:  # generated and counted, though its text is not returned
            choice.tokens += 1
        piece = choice.stream.push(chunk.token_ids) if chunk.token_ids else ""
        if chunk.finish_reason is not None:
            piece += choice.stream.finish()
            choice.settled = True
            choice.answer.finish_reason = chunk.finish_reason
        if choice.stream.stopped:
            choice.answer.finish_reason = "stop"
        choice.answer.text += piece
        chosen = (*chunk.token_ids, *([chunk.stop_token] if chunk.stop_token is not None else []))
        entries = [(t, lp, top) for t, (lp, top) in zip(chosen, chunk.logprobs, strict=True)] if chunk.logprobs else []
        if piece or entries:
            events.append(self._event(choice, piece, entries))
        if choice.stream.stopped and choice.answer.logprobs is not None:
            self._cut_at_stop(choice)
        return events

    def _cut_at_stop(self, choice: _Choice) -> None:
        """Keep the log-probabilities of the generated tokens whose text a stop string left
        (at least in part); drop those after it."""
        logprobs = choice.answer.logprobs
        assert logprobs is not None
        first = len(logprobs) - choice.tokens  # the echoed prompt's entries come before
        kept = len(choice.answer.text) - choice.answer.offset
        at, keep = 0, first
        for token, _, _ in logprobs[first:]:
            if at >= kept:
                break
            at += len(self._piece(token))
            keep += 1
        del logprobs[keep:]

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
        await self._backend.abort(self.request_id)

    def _count(self, choice: _Choice, token_ids: Sequence[int]) -> None:
        if token_ids and self.completion_tokens == 0:
            self._metrics.time_to_first_token.observe(time.monotonic() - self.job.arrived)
        choice.tokens += len(token_ids)
        self._metrics.generation_tokens.inc(len(token_ids))
