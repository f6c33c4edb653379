"""OpenAI's wire format: the request models the server validates and the responses it builds.

Requests are pydantic models that refuse unknown fields (naming them) and accept OpenAI's
optional fields that this server does not implement only at the value that turns them off
(``n=1``, ``echo=false``, no penalties, no logprobs), so a client never gets a silently
different answer from the one it asked for. Responses are plain dicts in OpenAI's shapes,
built by :class:`CompletionShape` and :class:`ChatShape`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n}: this server returns one choice per request (n must be 1)")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError(f"{value}: penalties are not supported (leave them out or 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported (leave it out or empty)")
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
    """``POST /v1/completions``. ``prompt`` is a string, a list of one string, or token ids."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: up to the context
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("the prompt is empty")
            if isinstance(prompt[0], str) and len(prompt) != 1:
                raise ValueError(f"got {len(prompt)} prompts: this server takes one prompt per request")
            if isinstance(prompt[0], int) and min(prompt) < 0:  # type: ignore[type-var]
                raise ValueError(f"token id {min(prompt)} is negative")  # type: ignore[type-var]
        return prompt

    @model_validator(mode="after")
    def _only_supported(self) -> CompletionRequest:
        unsupported = {
            "echo": self.echo,
            "logprobs": self.logprobs,  # 0 still asks for the sampled token's logprob
            "suffix": self.suffix,
            "best_of": self.best_of not in (None, 1),
        }
        for name, value in unsupported.items():
            if value not in (None, False):
                raise ValueError(f"{name} is not supported by this server (leave it out)")
        return self

    def prompt_text_or_ids(self) -> str | list[int]:
        """The one prompt: a string, or token ids."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]


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
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported by this server (leave them out)")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
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
    "prompt": "a string, a list of one string, or a list of token ids",
    "stop": "a string or a list of strings",
}


def _is_union_branch(part: object) -> bool:
    """Pydantic names the union member it tried (``str``, ``list[int]``) inside the location."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One entry of ``GET /v1/models``."""
    return {"id": name, "object": "model", "created": created, "owned_by": "tessera", "max_model_len": max_model_len}


class CompletionShape:
    """The bodies of one ``/v1/completions`` answer: the whole response, or its stream's chunks."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def response(self, text: str, finish_reason: str | None, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "choices": [self._choice(text, finish_reason)], "usage": usage_}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, text: str) -> dict[str, Any]:
        return {**self._head, "choices": [self._choice(text, None)]}

    def closing_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return {**self._head, "choices": [self._choice("", finish_reason)]}

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage_}

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


class ChatShape:
    """The bodies of one ``/v1/chat/completions`` answer. A stream opens with the assistant's
    role, carries the content in ``delta`` pieces and closes with an empty delta and the finish reason."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = {"id": request_id, "created": created, "model": model}

    def response(self, text: str, finish_reason: str | None, usage_: dict[str, int]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        return {**self._head, "object": "chat.completion", "choices": [choice], "usage": usage_}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def closing_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "object": "chat.completion.chunk", "choices": [], "usage": usage_}

    def _chunk(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head, "object": "chat.completion.chunk", "choices": [choice]}
