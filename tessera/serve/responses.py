"""OpenAI's wire format, answers: the response bodies the server builds (plain dicts in OpenAI's
shapes, by :class:`CompletionShape` and :class:`ChatShape`), the log-probabilities in each
endpoint's format, the error object, usage, the model card, and the server-sent events a stream
is made of."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# One token's log-probabilities as the server keeps them: the token, its log-probability (None
# for a prompt's first token, which nothing predicts) and the most likely alternatives.
LogprobEntry = tuple[int, float | None, tuple[tuple[int, float], ...]]


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


@dataclass
class ChoiceAnswer:
    """One choice's answer so far: its text, why it ended, and its tokens' log-probabilities
    (None when the request asked for none)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    offset: int = 0  # where the generated text starts in ``text`` (after an echoed prompt)
    extra: dict[str, Any] = field(default_factory=dict)


def completion_logprobs(
    entries: Sequence[LogprobEntry], piece: Callable[[int], str], start: int = 0
) -> dict[str, list[Any]]:
    """The completions endpoint's ``logprobs``: ``tokens`` (each token's text), ``token_logprobs``,
    ``top_logprobs`` (per token a ``{text: logprob}`` of the most likely tokens and the chosen
    one; None where the token has none) and ``text_offset`` (where each token's text starts,
    from ``start``)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = start
    for token, logprob, top in entries:
        text = piece(token)
        tokens.append(text)
        values.append(logprob)
        offsets.append(at)
        at += len(text)
        if logprob is None:
            tops.append(None)
            continue
        alternatives = {piece(t): v for t, v in top}
        alternatives.setdefault(text, logprob)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[LogprobEntry], piece: Callable[[int], str]) -> dict[str, Any]:
    """The chat endpoint's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, logprob, top in entries:
        item = one(token, logprob if logprob is not None else 0.0)
        item["top_logprobs"] = [one(t, v) for t, v in top]
        content.append(item)
    return {"content": content}


class CompletionShape:
    """The bodies of one ``/v1/completions`` answer: the whole response, or its stream's chunks."""

    def __init__(self, request_id: str, created: int, model: str, piece: Callable[[int], str]) -> None:
        self._head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        self._piece = piece

    def response(self, choices: Sequence[ChoiceAnswer], usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "choices": [self._choice(c) for c in choices], "usage": usage_}

    def opening_chunks(self, count: int) -> list[dict[str, Any]]:
        return []

    def text_chunk(
        self, index: int, text: str, entries: Sequence[LogprobEntry] | None = None, start: int = 0
    ) -> dict[str, Any]:
        logprobs = completion_logprobs(entries, self._piece, start) if entries is not None else None
        return {**self._head, "choices": [{"index": index, "text": text, "finish_reason": None, "logprobs": logprobs}]}

    def closing_chunk(self, index: int, finish_reason: str | None) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [{"index": index, "text": "", "finish_reason": finish_reason, "logprobs": None}],
        }

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage_}

    def _choice(self, choice: ChoiceAnswer) -> dict[str, Any]:
        logprobs = completion_logprobs(choice.logprobs, self._piece) if choice.logprobs is not None else None
        return {"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason, "logprobs": logprobs}


class ChatShape:
    """The bodies of one ``/v1/chat/completions`` answer. A stream opens with the assistant's
    role, carries the content in ``delta`` pieces and closes with an empty delta and the finish reason."""

    def __init__(self, request_id: str, created: int, model: str, piece: Callable[[int], str]) -> None:
        self._head = {"id": request_id, "created": created, "model": model}
        self._piece = piece

    def response(self, choices: Sequence[ChoiceAnswer], usage_: dict[str, int]) -> dict[str, Any]:
        body = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": chat_logprobs(c.logprobs, self._piece) if c.logprobs is not None else None,
            }
            for c in choices
        ]
        return {**self._head, "object": "chat.completion", "choices": body, "usage": usage_}

    def opening_chunks(self, count: int) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(count)]

    def text_chunk(
        self, index: int, text: str, entries: Sequence[LogprobEntry] | None = None, start: int = 0
    ) -> dict[str, Any]:
        logprobs = chat_logprobs(entries, self._piece) if entries is not None else None
        return self._chunk(index, {"content": text}, None, logprobs)

    def closing_chunk(self, index: int, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(index, {}, finish_reason)

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "object": "chat.completion.chunk", "choices": [], "usage": usage_}

    def _chunk(
        self, index: int, delta: dict[str, str], finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self._head, "object": "chat.completion.chunk", "choices": [choice]}


def server_sent_event(data: dict[str, Any]) -> str:
    """One ``data: {json}`` event of a stream, with its blank line."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
