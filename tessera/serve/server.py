"""What the OpenAI-compatible server does, apart from the web framework: a request read and
validated (:mod:`tessera.serve.protocol`), authorized and admitted within the limits, run as a
:class:`~tessera.serve.generation.Job` on the backend, and answered whole or as server-sent
events (:mod:`tessera.serve.responses`), with the metrics counted. :mod:`tessera.serve.app`
routes FastAPI's requests to :class:`OpenAIServer`."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tessera.serve.backend import Backend, Tokenizer
from tessera.serve.generation import Event, Generation, Job
from tessera.serve.metrics import ServerMetrics
from tessera.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Limits,
    SamplingFields,
    check_model,
    check_prompt_length,
    check_token_ids,
    parse_request,
    read_json_body,
    resolve_max_tokens,
    sampling_params,
)
from tessera.serve.responses import (
    DONE_EVENT,
    ChatShape,
    CompletionShape,
    error_body,
    model_card,
    server_sent_event,
    usage,
)

if TYPE_CHECKING:
    from starlette.requests import Request

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MODELS = "/v1/models"
# Status counted for a client that left before its answer was complete (nginx's convention).
CLIENT_GONE = 499


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt's token ids: the tokenizer's chat template with the generation prompt when it
    has one, else ``"<role>: <content>\\n"`` per message then ``"assistant: "``."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        text = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant: "
        return list(tokenizer.encode(text))
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    except Exception as error:  # templates raise on conversations they refuse (roles out of turn)
        raise APIError(400, f"the model's chat template refused these messages: {error}", param="messages") from error
    # The template writes the model's special tokens itself; encoding would add BOS twice.
    if "add_special_tokens" in inspect.signature(tokenizer.encode).parameters:
        return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]
    return list(tokenizer.encode(text))


def bearer_token(authorization: str | None) -> str | None:
    """The key of ``Authorization: Bearer KEY``, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (its body already read, receive() reports only that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(generation: Generation) -> None:
    """Every event of ``generation`` (its answers fill as they come)."""
    async for _ in generation.events():
        pass


async def answers_unless_client_leaves(request: Request, generations: Sequence[Generation]) -> bool:
    """Run every prompt's generation to its end; False when the client left first (the
    generations are then cancelled; :meth:`Generation.close` aborts them)."""
    collector: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(run_to_end(g) for g in generations)))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        collector.cancel()  # no-op once done
        watcher.cancel()
        await asyncio.gather(collector, watcher, return_exceptions=True)
    if collector.cancelled():
        return False
    collector.result()  # an exception in a generation is raised here
    return True


async def merged(generations: Sequence[Generation]) -> AsyncIterator[Event]:
    """The events of several generations as they come (one generation: its own, in order)."""
    if len(generations) == 1:
        async for event in generations[0].events():
            yield event
        return
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    async def pump(generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put(event)
        except BaseException as error:  # handed to the consumer, which raises it
            await queue.put(error)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g)) for g in generations]
    running = len(tasks)
    try:
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(generations: Sequence[Generation]) -> dict[str, int]:
    """OpenAI's ``usage``: every prompt's tokens once, every choice's generated tokens."""
    return usage(sum(len(g.job.prompts[g.prompt]) for g in generations), sum(g.completion_tokens for g in generations))


class OpenAIServer:
    """What the routes do, apart from FastAPI: validation, limits, running jobs, metrics."""

    def __init__(self, backend: Backend, served_name: str, limits: Limits, api_key: str | None) -> None:
        self.backend = backend
        self.served_name = served_name
        self.limits = limits
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.in_flight = 0  # generation requests admitted and not yet answered

    # Refusals --------------------------------------------------------------------------------

    def authorize(self, authorization: str | None) -> None:
        """401 unless the server has no key or ``authorization`` is ``Bearer <key>``."""
        if self.api_key is None:
            return
        given = bearer_token(authorization)
        if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            what = "missing" if given is None else "wrong"
            message = f"{what} API key: send the header 'Authorization: Bearer <key>' with this server's key"
            raise APIError(401, message, "authentication_error", code="invalid_api_key")

    def admit(self) -> None:
        """Take a slot among the concurrent requests, or 429; :meth:`release` gives it back."""
        if self.in_flight >= self.limits.max_concurrent_requests:
            message = (
                f"the server is answering its maximum of {self.limits.max_concurrent_requests} "
                "requests at once; try again shortly"
            )
            raise APIError(429, message, "rate_limit_error", code="too_many_requests")
        self.in_flight += 1

    def release(self) -> None:
        """Give back the slot :meth:`admit` took."""
        self.in_flight -= 1

    # Requests to jobs ------------------------------------------------------------------------

    def completion_job(self, body: Any, arrived: float) -> Job:
        """A ``/v1/completions`` body as a job (each prompt encoded, or its token ids checked)."""
        request: CompletionRequest = parse_request(CompletionRequest, body)
        adapter = check_model(request.model, self.served_name, self.backend.info.adapters)
        prompts = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                prompts.append(list(self.backend.tokenizer.encode(prompt)))
            else:
                prompts.append(check_token_ids(prompt, self.backend.info.vocab_size))
        if len(prompts) * request.n > self.limits.max_choices:
            message = f"{len(prompts)} prompts x n={request.n} choices is more than this server answers at once ({self.limits.max_choices})"
            raise APIError(400, message, param="n")
        logprobs = request.logprobs
        return self.job(
            request,
            prompts,
            request.max_tokens,
            COMPLETIONS,
            arrived,
            adapter,
            logprobs=logprobs,
            echo=request.echo,
        )

    def chat_job(self, body: Any, arrived: float) -> Job:
        """A ``/v1/chat/completions`` body as a job (the messages through the chat template)."""
        request: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
        adapter = check_model(request.model, self.served_name, self.backend.info.adapters)
        prompt_ids = chat_prompt(self.backend.tokenizer, request.messages)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return self.job(
            request, [prompt_ids], request.requested_max_tokens, CHAT_COMPLETIONS, arrived, adapter, logprobs=logprobs
        )

    def job(
        self,
        request: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        endpoint: str,
        arrived: float,
        adapter: str | None = None,
        *,
        logprobs: int | None = None,
        echo: bool = False,
    ) -> Job:
        """The checks and the parts both endpoints share, and the job's id and response shape
        (answering under the adapter's name when the request named one)."""
        context = self.backend.info.max_model_len
        granted = []
        for prompt_ids in prompts:
            check_prompt_length(len(prompt_ids), self.limits)
            granted.append(resolve_max_tokens(max_tokens, len(prompt_ids), context, self.limits))
        params = sampling_params(
            request,
            min(granted),
            self.backend.tokenizer.eos_token_id,
            vocab_size=self.backend.info.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
        )
        chat = endpoint == CHAT_COMPLETIONS
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shape_type = ChatShape if chat else CompletionShape
        tokenizer = self.backend.tokenizer
        return Job(
            request_id=request_id,
            endpoint=endpoint,
            prompts=prompts,
            params=params,
            stream=request.stream,
            include_usage=request.include_usage,
            shape=shape_type(
                request_id, int(time.time()), adapter or self.served_name, lambda t: tokenizer.decode([t])
            ),
            arrived=arrived,
            adapter=adapter,
            echo=echo,
            logprobs=logprobs is not None,
            prompt_texts=[tokenizer.decode(p) for p in prompts] if echo else [],
        )

    async def admitted_job(self, request: Request, build: Callable[[Any, float], Job]) -> Job:
        """Read, validate and admit a generation request (taking a slot: release it)."""
        arrived = time.monotonic()
        body = await read_json_body(request, self.limits.max_body_bytes)
        job = build(body, arrived)
        self.admit()
        self.metrics.prompt_tokens.inc(sum(len(p) for p in job.prompts))
        return job

    # Answers ---------------------------------------------------------------------------------

    async def answer(self, job: Job, request: Request) -> dict[str, Any] | None:
        """The whole answer's JSON, or None when the client left; 500 when the engine failed."""
        generations = [Generation(self.backend, job, self.metrics, i) for i in range(len(job.prompts))]
        try:
            done = await answers_unless_client_leaves(request, generations)
        finally:
            await self.finish(job, generations)
        if not done:
            self.count(job.endpoint, CLIENT_GONE)
            return None
        failed = next((g.error for g in generations if g.error is not None), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed}", "server_error", code="engine_error")
        self.count(job.endpoint, 200)
        choices = [answer for g in generations for answer in g.answers]
        return job.shape.response(choices, total_usage(generations))

    def stream(self, job: Job) -> tuple[AsyncIterator[str], Callable[[], Awaitable[None]]]:
        """The answer as server-sent events, and what to run once the response is over (however
        it ended: complete, the client gone, never started)."""
        generations = [Generation(self.backend, job, self.metrics, i) for i in range(len(job.prompts))]

        async def on_close() -> None:
            await self.finish(job, generations)
            ended = all(g.ended for g in generations)
            failed = any(g.error for g in generations)
            self.count(job.endpoint, 500 if failed else 200 if ended else CLIENT_GONE)

        return self.events(job, generations), on_close

    async def events(self, job: Job, generations: list[Generation]) -> AsyncIterator[str]:
        """Opening chunks, a chunk per text piece of each choice, then each choice's closing
        chunk (and usage when asked) or an error event; ``[DONE]`` last."""
        shape = job.shape
        for chunk in shape.opening_chunks(job.choices):
            yield server_sent_event(chunk)
        try:
            async for event in merged(generations):
                yield server_sent_event(shape.text_chunk(event.index, event.text, event.entries, event.start))
        except Exception as error:  # the 200 is sent: the client hears of it as an error event
            log.exception("request %s failed while streaming", job.request_id)
            generations[0].fail(internal_error(error).message)
        failed = next((g.error for g in generations if g.error is not None), None)
        if failed is not None:
            message = f"generation failed: {failed}"
            yield server_sent_event(error_body(message, "server_error", code="engine_error"))
        else:
            for answer in (a for g in generations for a in g.answers):
                yield server_sent_event(shape.closing_chunk(answer.index, answer.finish_reason))
            if job.include_usage:
                yield server_sent_event(shape.usage_chunk(total_usage(generations)))
        yield DONE_EVENT

    async def finish(self, job: Job, generations: Sequence[Generation]) -> None:
        """After an answer: the backend's requests aborted or closed, the slot released, the
        latency recorded."""
        try:
            for generation in generations:
                await generation.close()
        finally:
            self.release()
            self.metrics.latency.observe(time.monotonic() - job.arrived)

    # Other endpoints -------------------------------------------------------------------------

    def count(self, endpoint: str, status: int) -> None:
        """One request to ``endpoint`` answered with ``status``, in ``tessera_requests_total``."""
        self.metrics.requests.inc(endpoint=endpoint, status=str(status))

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the served model, then each LoRA adapter served over it."""
        return {
            "object": "list",
            "data": [self.model(name) for name in (self.served_name, *self.backend.info.adapters)],
        }

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``; 404 for a name that is neither the model nor an adapter."""
        adapter = check_model(name, self.served_name, self.backend.info.adapters)
        parent = self.served_name if adapter is not None else None
        return model_card(name, self.created, self.backend.info.max_model_len, parent=parent)

    def metrics_page(self) -> str:
        """``GET /metrics``: the server's counters and the engine's gauges, Prometheus' text format."""
        try:
            engine_stats = self.backend.stats()
        except Exception:  # the counters are still worth reading when the engine's gauges fail
            log.exception("backend.stats() failed; /metrics leaves the engine's gauges out")
            engine_stats = {}
        return self.metrics.render(engine_stats, self.in_flight)


def internal_error(error: Exception) -> APIError:
    """The 500 for an exception nobody expected; its details stay in the server's log."""
    message = f"internal server error ({type(error).__name__}); see the server's log"
    return APIError(500, message, "server_error")
