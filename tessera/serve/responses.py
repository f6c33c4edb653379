"""OpenAI's wire format, answers: the response bodies the server builds (plain dicts in OpenAI's
shapes, by :class:`CompletionShape` and :class:`ChatShape`), the error object, usage, the model
card, and the server-sent events a stream is made of."""

from __future__ import annotations

import json
from typing import Any


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, max_model_len: int, parent: str | None = None) -> dict[str, Any]:
    """One entry of ``GET /v1/models``; a LoRA adapter's names its base as ``parent`` (vLLM's field)."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "tessera", "max_model_len": max_model_len}
    return card if parent is None else {**card, "parent": parent}


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


def server_sent_event(data: dict[str, Any]) -> str:
    """One ``data: {json}`` event of a stream, with its blank line."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
