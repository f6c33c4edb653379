"""The OpenAI-compatible HTTP server over a :class:`~tessera.serve.backend.Backend`.

``create_app`` builds a FastAPI app with ``POST /v1/completions``, ``POST /v1/chat/completions``
(both streamed as server-sent events on ``stream: true``), ``GET /v1/models``, ``GET /health``
and ``GET /metrics``. The app turns requests into token ids and :class:`SamplingParams`, runs
them on the backend and turns the tokens back into text with
:class:`~tessera.inference.text.TextStream`, which also finds the stop strings.

Every refusal is OpenAI's error JSON with a status: 400 for a bad request, 401 for a missing or
wrong API key, 404 for another model's name, 413 for a body over the limit, 429 beyond the
concurrent requests allowed, 500 when the engine fails. A request that ends early (its client
left, or a stop string matched) is aborted in the backend, so its KV blocks are freed at once.

FastAPI is imported inside ``create_app`` (``pip install 'tessera[serve]'``). This module has
no ``from __future__ import annotations``: FastAPI reads the routes' annotations at runtime,
and the routes are closures over names imported inside ``create_app``.
"""

import asyncio
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError
from tessera.inference.params import SamplingParams
from tessera.serve.backend import Backend, Tokenizer
from tessera.serve.generation import Generation, Job
from tessera.serve.metrics import CONTENT_TYPE, ServerMetrics
from tessera.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    SamplingFields,
    error_body,
    model_card,
    validation_message,
)

if TYPE_CHECKING:
    import fastapi
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MODELS = "/v1/models"
# Status counted for a client that left before its answer was complete (nginx's convention).
CLIENT_GONE = 499


@dataclass(frozen=True)
class Limits:
    """What one server accepts. A request beyond a limit is refused with the status named."""

    max_prompt_tokens: int = 4096
    """Longest prompt, in tokens (400)."""
    max_tokens: int = 1024
    """Most tokens one request may ask to generate (400); a chat request that gives no
    max_tokens gets this, or what the model's context leaves if that is less."""
    max_concurrent_requests: int = 64
    """Generation requests answered at once, streams included; one more gets 429."""
    max_body_bytes: int = 1 << 20
    """Largest request body in bytes (413)."""

    def __post_init__(self) -> None:
        for limit in fields(self):
            value = getattr(self, limit.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Limits.{limit.name}={value!r} must be an integer of at least 1")


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def server_sent_event(data: dict[str, Any]) -> str:
    """One ``data: {json}`` event of a stream, with its blank line."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


async def read_json_body(request: "Request", max_bytes: int) -> Any:
    """The request's JSON body; 413 past ``max_bytes`` (by its Content-Length before reading,
    or as it arrives), 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(int(declared), max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise body_too_large(len(body), max_bytes)
    try:
        return json.loads(body)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from error


def body_too_large(size: int, max_bytes: int) -> APIError:
    message = f"the request body has {size} bytes or more; this server takes at most {max_bytes}"
    return APIError(413, message, code="request_too_large")


def parse_request(model_type: type[SamplingFields], body: Any) -> Any:
    """``body`` validated as ``model_type``; 400 naming the first bad field."""
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_type.model_validate(body)
    except ValidationError as error:
        message, param = validation_message(error)
        raise APIError(400, message, param=param) from error


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


def wants_param(message: str) -> str | None:
    """The field a SamplingParams error names (``"top_p=2 must be ..."`` -> ``"top_p"``)."""
    name = message.split("=", 1)[0]
    return name if "=" in message and name.isidentifier() else None


def bearer_token(authorization: str | None) -> str | None:
    """The key of ``Authorization: Bearer KEY``, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def wait_for_disconnect(request: "Request") -> None:
    """Returns when the client has gone (its body already read, receive() reports only that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def join_pieces(generation: Generation) -> str:
    """The whole answer's text."""
    return "".join([piece async for piece in generation.pieces()])


async def text_unless_client_leaves(request: "Request", generation: Generation) -> str | None:
    """The whole answer's text, or None when the client left first (the generation is then
    cancelled; :meth:`Generation.close` aborts it)."""
    collector = asyncio.ensure_future(join_pieces(generation))
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        collector.cancel()  # no-op once done
        watcher.cancel()
        await asyncio.gather(collector, watcher, return_exceptions=True)
    return None if collector.cancelled() else collector.result()


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

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is the served model's (or None: a request that names none)."""
        if name is not None and name != self.served_name:
            message = f"the model {name!r} does not exist; this server serves {self.served_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int]) -> list[int]:
        """``ids`` (a prompt given as token ids), or 400 when one is outside the vocabulary."""
        vocab_size = self.backend.info.vocab_size
        if max(ids) >= vocab_size:
            message = f"prompt token id {max(ids)} is outside the vocabulary (ids 0 to {vocab_size - 1})"
            raise APIError(400, message, param="prompt")
        return ids

    def check_prompt_length(self, prompt_tokens: int) -> None:
        """400 for an empty prompt or one over ``limits.max_prompt_tokens``."""
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty (0 tokens)", param="prompt")
        if prompt_tokens > self.limits.max_prompt_tokens:
            message = (
                f"the prompt has {prompt_tokens} tokens; this server takes at most {self.limits.max_prompt_tokens}"
            )
            raise APIError(400, message, param="prompt", code="context_length_exceeded")

    def resolve_max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        """The request's max_tokens, checked against the server's cap and the context; when
        None, as many as both allow."""
        context = self.backend.info.max_model_len
        room = context - prompt_tokens
        if requested is None:
            if room < 1:
                message = f"the prompt has {prompt_tokens} tokens, which fills the model's context of {context} tokens"
                raise APIError(400, message, param="prompt", code="context_length_exceeded")
            return min(self.limits.max_tokens, room)
        if requested > self.limits.max_tokens:
            message = f"max_tokens={requested} is more than this server allows ({self.limits.max_tokens})"
            raise APIError(400, message, param="max_tokens")
        if requested > room:
            message = (
                f"the model's context is {context} tokens; the prompt has {prompt_tokens} and max_tokens "
                f"asks for {requested} more ({prompt_tokens + requested} in all)"
            )
            raise APIError(400, message, param="max_tokens", code="context_length_exceeded")
        return requested

    def sampling_params(self, request: SamplingFields, max_tokens: int) -> SamplingParams:
        """The request's sampling fields with their defaults, and the tokenizer's end-of-sequence
        id as a stop token; 400 naming the field SamplingParams refuses."""
        eos = self.backend.tokenizer.eos_token_id
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_k=0 if request.top_k is None else request.top_k,
                top_p=1.0 if request.top_p is None else request.top_p,
                seed=request.seed,
                stop=request.stop_strings(),
                stop_token_ids=() if eos is None else (eos,),
            )
        except ValueError as error:
            raise APIError(400, str(error), param=wants_param(str(error))) from error

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
        """A ``/v1/completions`` body as a job (the prompt encoded, or its token ids checked)."""
        request: CompletionRequest = parse_request(CompletionRequest, body)
        self.check_model(request.model)
        prompt = request.prompt_text_or_ids()
        if isinstance(prompt, str):
            prompt_ids = list(self.backend.tokenizer.encode(prompt))
        else:
            prompt_ids = self.check_token_ids(prompt)
        return self.job(request, prompt_ids, request.max_tokens, COMPLETIONS, arrived)

    def chat_job(self, body: Any, arrived: float) -> Job:
        """A ``/v1/chat/completions`` body as a job (the messages through the chat template)."""
        request: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
        self.check_model(request.model)
        prompt_ids = chat_prompt(self.backend.tokenizer, request.messages)
        return self.job(request, prompt_ids, request.requested_max_tokens, CHAT_COMPLETIONS, arrived)

    def job(
        self, request: SamplingFields, prompt_ids: list[int], max_tokens: int | None, endpoint: str, arrived: float
    ) -> Job:
        """The checks and the parts both endpoints share, and the job's id and response shape."""
        self.check_prompt_length(len(prompt_ids))
        params = self.sampling_params(request, self.resolve_max_tokens(max_tokens, len(prompt_ids)))
        chat = endpoint == CHAT_COMPLETIONS
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shape_type = ChatShape if chat else CompletionShape
        return Job(
            request_id=request_id,
            endpoint=endpoint,
            prompt_ids=prompt_ids,
            params=params,
            stream=request.stream,
            include_usage=request.include_usage,
            shape=shape_type(request_id, int(time.time()), self.served_name),
            arrived=arrived,
        )

    async def admitted_job(self, request: "Request", build: Callable[[Any, float], Job]) -> Job:
        """Read, validate and admit a generation request (taking a slot: release it)."""
        arrived = time.monotonic()
        body = await read_json_body(request, self.limits.max_body_bytes)
        job = build(body, arrived)
        self.admit()
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        return job

    # Answers ---------------------------------------------------------------------------------

    async def answer(self, job: Job, request: "Request") -> dict[str, Any] | None:
        """The whole answer's JSON, or None when the client left; 500 when the engine failed."""
        generation = Generation(self.backend, job, self.metrics)
        try:
            text = await text_unless_client_leaves(request, generation)
        finally:
            await self.finish(generation)
        if text is None:
            self.count(job.endpoint, CLIENT_GONE)
            return None
        if generation.error is not None:
            raise APIError(500, f"generation failed: {generation.error}", "server_error", code="engine_error")
        self.count(job.endpoint, 200)
        return job.shape.response(text, generation.finish_reason, generation.usage())

    def stream(self, job: Job) -> tuple[AsyncIterator[str], Callable[[], Awaitable[None]]]:
        """The answer as server-sent events, and what to run once the response is over (however
        it ended: complete, the client gone, never started)."""
        generation = Generation(self.backend, job, self.metrics)

        async def on_close() -> None:
            await self.finish(generation)
            status = 200 if generation.finish_reason else 500 if generation.error else CLIENT_GONE
            self.count(job.endpoint, status)

        return self.events(generation), on_close

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        """Opening chunks, a chunk per text piece, then the closing chunk (and usage when asked)
        or an error event; ``[DONE]`` last."""
        shape = generation.job.shape
        for chunk in shape.opening_chunks():
            yield server_sent_event(chunk)
        try:
            async for piece in generation.pieces():
                yield server_sent_event(shape.text_chunk(piece))
        except Exception as error:  # the 200 is sent: the client hears of it as an error event
            log.exception("request %s failed while streaming", generation.job.request_id)
            generation.fail(internal_error(error).message)
        if generation.error is not None:
            message = f"generation failed: {generation.error}"
            yield server_sent_event(error_body(message, "server_error", code="engine_error"))
        else:
            yield server_sent_event(shape.closing_chunk(generation.finish_reason))
            if generation.job.include_usage:
                yield server_sent_event(shape.usage_chunk(generation.usage()))
        yield DONE_EVENT

    async def finish(self, generation: Generation) -> None:
        """After an answer: the backend's request aborted or closed, the slot released, the
        latency recorded."""
        try:
            await generation.close()
        finally:
            self.release()
            self.metrics.latency.observe(time.monotonic() - generation.job.arrived)

    # Other endpoints -------------------------------------------------------------------------

    def count(self, endpoint: str, status: int) -> None:
        """One request to ``endpoint`` answered with ``status``, in ``tessera_requests_total``."""
        self.metrics.requests.inc(endpoint=endpoint, status=str(status))

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the one served model."""
        card = model_card(self.served_name, self.created, self.backend.info.max_model_len)
        return {"object": "list", "data": [card]}

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``; 404 for another name."""
        self.check_model(name)
        return model_card(self.served_name, self.created, self.backend.info.max_model_len)

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


def require_fastapi() -> Any:
    """The ``fastapi`` module, or an ImportError that says how to install it."""
    try:
        import fastapi
    except ImportError as error:
        raise ImportError("tessera serve needs FastAPI and uvicorn: pip install 'tessera[serve]'") from error
    return fastapi


def event_stream_response(events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> "Response":
    """A ``text/event-stream`` response that runs ``on_close`` however it ends, even when the
    client left before its first byte (then ``events`` never starts, so its own ``finally``
    would not run)."""
    from starlette.responses import StreamingResponse

    class EventStreamResponse(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await on_close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
    return EventStreamResponse(events, media_type="text/event-stream", headers=headers)


def create_app(backend: Backend, *, served_name: str, limits: Limits, api_key: str | None = None) -> "fastapi.FastAPI":
    """The OpenAI-compatible app serving ``backend``'s model as ``served_name``.

    ``api_key``: when set, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``.
    The app owns the backend from here on: it closes it when the server shuts down (the
    backend's connections live on the server's event loop).
    """
    fastapi = require_fastapi()
    from fastapi import Depends, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    server = OpenAIServer(backend, served_name, limits, api_key)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = fastapi.FastAPI(title="tessera", lifespan=lifespan)
    app.state.server = server  # for tests and extensions

    async def authorize(request: Request) -> None:
        server.authorize(request.headers.get("authorization"))

    async def on_api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)
        if request.url.path in (COMPLETIONS, CHAT_COMPLETIONS, MODELS):
            server.count(request.url.path, error.status)
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def on_http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        body = error_body(str(error.detail), "invalid_request_error", code=str(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    async def on_unexpected_error(request: Request, error: Exception) -> Response:
        # A last resort (the generation routes answer their own): uvicorn logs the traceback
        # after this answer and the server goes on.
        if request.url.path in (COMPLETIONS, CHAT_COMPLETIONS, MODELS):
            server.count(request.url.path, 500)
        return JSONResponse(internal_error(error).body(), status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)

    async def generate(request: Request, build: Callable[[Any, float], Job]) -> Response:
        try:
            job = await server.admitted_job(request, build)
            if job.stream:
                return event_stream_response(*server.stream(job))
            body = await server.answer(job, request)
        except APIError:
            raise
        except Exception as error:
            # Answered here rather than by on_unexpected_error: Starlette re-raises after that
            # handler, and uvicorn then closes the connection, which can cut off the answer.
            log.exception("%s failed", request.url.path)
            raise internal_error(error) from error
        return Response(status_code=CLIENT_GONE) if body is None else JSONResponse(body)

    router = fastapi.APIRouter(dependencies=[Depends(authorize)])

    @router.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await generate(request, server.completion_job)

    @router.post(CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, server.chat_job)

    @router.get(MODELS)
    async def models() -> dict[str, Any]:
        server.count(MODELS, 200)
        return server.models()

    @router.get(MODELS + "/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return server.model(name)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics_page(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(router)
    return app
