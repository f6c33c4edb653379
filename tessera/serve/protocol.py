"""OpenAI's wire format, requests: the request models the server validates, and the validation
of a request against the server's :class:`Limits` and the model (every refusal an
:class:`APIError` with its status). The answers are in :mod:`tessera.serve.responses`.

Requests are pydantic models that refuse unknown fields (naming them) and accept OpenAI's
optional fields that this server does not implement only at the value that turns them off
(``suffix`` left out, ``best_of`` equal to ``n``), so a client never gets a silently different
answer from the one it asked for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.errors import ConfigError
from tessera.inference.params import MAX_LOGPROBS, MAX_N, SamplingParams
from tessera.serve.responses import error_body

if TYPE_CHECKING:
    from starlette.requests import Request

# Roles a chat template may meet; "developer" is OpenAI's newer name for "system".
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with usage and no choices, before [DONE]


class SamplingFields(_Strict):
    """The fields completions and chat completions share. ``None`` means the default."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0; 0: greedy
    top_p: float | None = None  # default 1.0
    top_k: int | None = None  # an extension to OpenAI's API; default 0 (off)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted and not used
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n={n}: this server returns 1 to {MAX_N} choices per prompt")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValueError(f"{value} must be in [-2, 2]")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"{token!r}: the keys are token ids (as strings)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {token}: the bias {bias} must be in [-100, 100]")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple: ``"x"`` -> ``("x",)``, ``None`` -> ``()``."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, token ids, or a list of either (one
    choice per prompt and per ``n``, in that order). ``echo`` puts the prompt before each
    choice's text (and, with ``logprobs``, the prompt tokens' log-probabilities before the
    generated ones'); ``max_tokens=0`` with ``echo`` scores the prompt without generating."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: up to the context
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("the prompt is empty")
            for one in prompt if isinstance(prompt[0], list) else [prompt]:
                if isinstance(one, list) and not one:
                    raise ValueError("a prompt of token ids is empty")
                if isinstance(one, list) and isinstance(one[0], int) and min(one) < 0:
                    raise ValueError(f"token id {min(one)} is negative")
        return prompt

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={value}: this server returns 0 to {MAX_LOGPROBS} alternatives per token")
        return value

    @model_validator(mode="after")
    def _only_supported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported by this server (leave it out)")
        if self.best_of not in (None, self.n):
            raise ValueError(
                f"best_of={self.best_of}: this server returns every sequence it makes (give n, or best_of=n)"
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 0")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens=0 generates nothing: with echo=true it scores the prompt; else ask for at least 1"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(_Strict):
    """One message. ``content`` may be OpenAI's list of text parts, joined into one string."""

    role: ChatRole
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_joined(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or its newer name
    ``max_completion_tokens``) left out: as many as the context and the server's cap allow."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _only_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs={self.top_logprobs} must be from 0 to {MAX_LOGPROBS}")
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
        if self.requested_max_tokens is not None and self.requested_max_tokens < 1:
            raise ValueError(f"max_tokens={self.requested_max_tokens} must be at least 1")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """The first problem of a failed validation as ``(message, param)``: the field's dotted
    path and what is wrong, e.g. ``("messages.0.role: Input should be 'system', ...", "messages.0.role")``."""
    first = error.errors()[0]
    location = [str(part) for part in first["loc"] if not _is_union_branch(part)]
    param = ".".join(location) or None
    if any(_is_union_branch(part) for part in first["loc"]) and param in UNION_FIELDS:
        return f"{param} must be {UNION_FIELDS[param]}", param
    if first["type"] == "extra_forbidden":
        return f"unknown field {param!r}: this server does not take it", param
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "missing":
        return f"{param} is required", param
    return (f"{param}: {message}" if param else message), param


# Fields of several types: pydantic reports each type's failure; one sentence says it better.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
}


def _is_union_branch(part: object) -> bool:
    """Pydantic names the union member it tried (``str``, ``list[int]``) inside the location."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


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
    max_choices: int = 64
    """Most choices one request may ask for: its prompts times ``n`` (400)."""
    max_body_bytes: int = 1 << 20
    """Largest request body in bytes (413)."""

    def __post_init__(self) -> None:
        for limit in fields(self):
            value = getattr(self, limit.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Limits.{limit.name}={value!r} must be an integer of at least 1")


# ---- validation: a request against the server's limits and the model ---------------------------


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


async def read_json_body(request: Request, max_bytes: int) -> Any:
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


def wants_param(message: str) -> str | None:
    """The field a SamplingParams error names (``"top_p=2 must be ..."`` -> ``"top_p"``)."""
    name = message.split("=", 1)[0]
    return name if "=" in message and name.isidentifier() else None


def check_model(name: str | None, served_name: str, adapters: Sequence[str] = ()) -> str | None:
    """The LoRA adapter a request's ``model`` names: one of ``adapters``, or None for the served
    base model (or a request that names none); 404 for any other name."""
    if name is None or name == served_name:
        return None
    if name in adapters:
        return name
    message = f"the model {name!r} does not exist; this server serves {served_name!r}"
    if adapters:
        message += f" and its adapters {', '.join(map(repr, adapters))}"
    raise APIError(404, message, param="model", code="model_not_found")


def check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """``ids`` (a prompt given as token ids), or 400 when one is outside the vocabulary."""
    if max(ids) >= vocab_size:
        message = f"prompt token id {max(ids)} is outside the vocabulary (ids 0 to {vocab_size - 1})"
        raise APIError(400, message, param="prompt")
    return ids


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs, or 400 naming a token outside the vocabulary."""
    pairs = tuple((int(token), float(value)) for token, value in (bias or {}).items())
    for token, _ in pairs:
        if token >= vocab_size:
            message = f"logit_bias names token id {token}, outside the vocabulary (ids 0 to {vocab_size - 1})"
            raise APIError(400, message, param="logit_bias")
    return pairs


def check_prompt_length(prompt_tokens: int, limits: Limits) -> None:
    """400 for an empty prompt or one over ``limits.max_prompt_tokens``."""
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty (0 tokens)", param="prompt")
    if prompt_tokens > limits.max_prompt_tokens:
        message = f"the prompt has {prompt_tokens} tokens; this server takes at most {limits.max_prompt_tokens}"
        raise APIError(400, message, param="prompt", code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context: int, limits: Limits) -> int:
    """The request's max_tokens, checked against the server's cap and the model's ``context``
    (tokens); when None, as many as both allow."""
    room = context - prompt_tokens
    if requested is None:
        if room < 1:
            message = f"the prompt has {prompt_tokens} tokens, which fills the model's context of {context} tokens"
            raise APIError(400, message, param="prompt", code="context_length_exceeded")
        return min(limits.max_tokens, room)
    if requested > limits.max_tokens:
        message = f"max_tokens={requested} is more than this server allows ({limits.max_tokens})"
        raise APIError(400, message, param="max_tokens")
    if requested > room:
        message = (
            f"the model's context is {context} tokens; the prompt has {prompt_tokens} and max_tokens "
            f"asks for {requested} more ({prompt_tokens + requested} in all)"
        )
        raise APIError(400, message, param="max_tokens", code="context_length_exceeded")
    return requested


def sampling_params(
    request: SamplingFields,
    max_tokens: int,
    eos_token_id: int | None,
    *,
    vocab_size: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling fields with their defaults, and the tokenizer's end-of-sequence
    id as a stop token; 400 naming the field SamplingParams refuses."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=0 if request.top_k is None else request.top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop_strings(),
            stop_token_ids=() if eos_token_id is None else (eos_token_id,),
            n=request.n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            logit_bias=check_logit_bias(request.logit_bias, vocab_size),
        )
    except ValueError as error:
        raise APIError(400, str(error), param=wants_param(str(error))) from error
