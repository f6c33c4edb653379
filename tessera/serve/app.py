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
The requests' validation is :mod:`tessera.serve.protocol`, the answers' shapes
:mod:`tessera.serve.responses`, and what the routes do :class:`~tessera.serve.server.OpenAIServer`;
this module is the FastAPI app around them.

FastAPI is imported inside ``create_app`` (``pip install 'tessera[serve]'``). This module has
no ``from __future__ import annotations``: FastAPI reads the routes' annotations at runtime,
and the routes are closures over names imported inside ``create_app``.
"""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from tessera.serve.backend import Backend
from tessera.serve.generation import Job
from tessera.serve.metrics import CONTENT_TYPE
from tessera.serve.protocol import APIError, Limits
from tessera.serve.responses import error_body
from tessera.serve.server import CHAT_COMPLETIONS, CLIENT_GONE, COMPLETIONS, MODELS, OpenAIServer, internal_error

if TYPE_CHECKING:
    import fastapi
    from starlette.responses import Response

__all__ = ["Limits", "create_app"]

log = logging.getLogger(__name__)


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
