"""The examples of RLHF, read from JSONL files, and the tokenizers that turn them into ids.

Examples are frozen dataclasses read from JSONL files (one JSON object per line; other fields are
ignored, so a preference file also serves as a prompt file)::

    SFTExample(prompt, response)                 {"prompt": "...", "response": "..."}
    PreferenceExample(prompt, chosen, rejected)  {"prompt": "...", "chosen": "...", "rejected": "..."}
    PromptExample(prompt)                        {"prompt": "..."}

A tokenizer is anything with ``encode(text) -> list[int]`` and, optionally, ``eos_token_id`` and
``pad_token_id`` (tessera's ``ByteTokenizer`` has neither). A Hugging Face tokenizer is wrapped by
:func:`as_text_tokenizer` in :class:`HFTokenizer`, which encodes without special tokens and puts
the ones its tokenizer would put before a text (Llama's BOS) at the start of each prompt.
:mod:`tessera.rlhf.batches` tokenizes the examples and makes the batches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tessera.errors import TesseraError

__all__ = [
    "DataFileError",
    "HFTokenizer",
    "PreferenceExample",
    "PromptExample",
    "SFTExample",
    "TextTokenizer",
    "as_text_tokenizer",
    "default_pad_id",
    "load_preferences",
    "load_prompts",
    "load_sft",
    "prompts_from",
    "read_jsonl",
    "sft_from_preferences",
]


# ---- examples and JSONL files -----------------------------------------------------------------
@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response to imitate."""

    prompt: str
    response: str


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt, the preferred response (``chosen``) and a worse one (``rejected``)."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PromptExample:
    """A prompt to generate from (PPO, GRPO, evaluation)."""

    prompt: str


class DataFileError(TesseraError, ValueError):
    """A line of a data file is not what it should be; the message names the file and the line."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = Path(path)
        self.line = line


def _json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Each non-blank line of a JSONL file as (line number from 1, decoded object)."""
    path = Path(path)
    records = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataFileError(path, number, f"not UTF-8 text ({error.reason} at byte {error.start})") from None
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataFileError(path, number, f"not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(value, dict):
            raise DataFileError(path, number, f"expected a JSON object, got {_json_type(value)}")
        records.append((number, value))
    return records


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-blank line, in file order.

    Raises :class:`DataFileError` naming the file and line for text that is not UTF-8, not JSON,
    or not a JSON object.
    """
    return [record for _, record in _read_records(path)]


_HINTS = {
    "response": " (a preference file? sft_from_preferences(load_preferences(path)) trains on the chosen responses)",
}


def _load(path: str | Path, fields: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The string ``fields`` of every record of a JSONL file; errors name the file and line."""
    rows = []
    for number, record in _read_records(path):
        for name in fields:
            if name not in record:
                found = ", ".join(sorted(record)) or "none"
                raise DataFileError(path, number, f"missing field {name!r} (fields: {found}){_HINTS.get(name, '')}")
            if not isinstance(record[name], str):
                raise DataFileError(path, number, f"field {name!r} must be a string, got {_json_type(record[name])}")
        rows.append(tuple(record[name] for name in fields))
    if not rows:
        raise ValueError(f"{path}: no examples (the file has no non-blank line)")
    return rows


def load_sft(path: str | Path) -> list[SFTExample]:
    """The SFT examples of a JSONL file whose lines have string fields ``prompt`` and ``response``."""
    return [SFTExample(*row) for row in _load(path, ("prompt", "response"))]


def load_preferences(path: str | Path) -> list[PreferenceExample]:
    """The preference pairs of a JSONL file whose lines have ``prompt``, ``chosen`` and ``rejected``."""
    return [PreferenceExample(*row) for row in _load(path, ("prompt", "chosen", "rejected"))]


def load_prompts(path: str | Path) -> list[PromptExample]:
    """The prompts of a JSONL file whose lines have a string ``prompt`` (SFT and preference files do)."""
    return [PromptExample(*row) for row in _load(path, ("prompt",))]


def sft_from_preferences(examples: Sequence[PreferenceExample]) -> list[SFTExample]:
    """SFT examples from preference pairs: each prompt with its chosen response."""
    return [SFTExample(e.prompt, e.chosen) for e in examples]


def prompts_from(examples: Sequence[SFTExample | PreferenceExample | PromptExample]) -> list[PromptExample]:
    """The prompt of each example, in order (a prompt that appears twice is kept twice)."""
    return [PromptExample(e.prompt) for e in examples]


# ---- tokenizers ---------------------------------------------------------------------------------
class TextTokenizer(Protocol):
    """What the datasets need of a tokenizer: ``encode(text) -> ids`` with no special tokens added.

    Optional attributes, read when present: ``eos_token_id`` (appended to responses),
    ``pad_token_id`` (the default padding id) and ``prefix_ids`` (put before every prompt).
    """

    def encode(self, text: str) -> list[int]: ...


def _special_prefix(tokenizer: Any) -> list[int]:
    """The special ids a Hugging Face tokenizer's ``encode`` puts before a text (Llama: [BOS])."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a"))
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


class HFTokenizer:
    """A Hugging Face tokenizer seen as a :class:`TextTokenizer`.

    ``encode(text)`` is ``tokenizer.encode(text, add_special_tokens=False)``; ``prefix_ids`` holds
    the special tokens that the tokenizer's own ``encode`` puts before a text (a BOS for Llama,
    none for GPT-2), which the datasets put at the start of each prompt; ``eos_token_id`` and
    ``pad_token_id`` are the tokenizer's.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.pad_token_id: int | None = tokenizer.pad_token_id
        self.prefix_ids: list[int] = _special_prefix(tokenizer)

    def encode(self, text: str) -> list[int]:
        """``text`` -> ids, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text, as the wrapped tokenizer decodes them."""
        return str(self.tokenizer.decode(list(ids)))


def as_text_tokenizer(tokenizer: Any) -> TextTokenizer:
    """``tokenizer`` as the datasets use it: a Hugging Face tokenizer (``transformers``
    ``PreTrainedTokenizerBase``) wrapped in :class:`HFTokenizer`, an :class:`HFTokenizer` or any
    other object with ``encode(text)`` as it is."""
    if any(cls.__name__ == "PreTrainedTokenizerBase" for cls in type(tokenizer).__mro__):
        return HFTokenizer(tokenizer)
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"{type(tokenizer).__name__} has no encode(text) method: it cannot tokenize the examples")
    return tokenizer


def default_pad_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's ``pad_token_id``, else its ``eos_token_id``, else 0.

    Which id pads does not matter for the results: every padded position is masked out.
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0
