"""From generated token ids to text: the byte-level tokenizer and incremental detokenization.

:class:`TextStream` turns a request's tokens, as they arrive, into text that is safe to show at
once: it never emits what a later token could change (half of a UTF-8 character, or the start
of what may turn out to be a stop string), so nothing emitted is ever taken back. The HTTP
server and ``tessera generate`` stream through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["ByteTokenizer", "Decoder", "TextStream"]

# What a byte-level decoder (ours, or a BPE's with errors="replace") ends with while the last
# character's UTF-8 bytes are not all there yet.
_INCOMPLETE = "\ufffd"


class ByteTokenizer:
    """The tokenizer of tessera's byte-level GPT: one token per UTF-8 byte, ids 0..255."""

    eos_token_id: int | None = None
    vocab_size = 256
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        """``text`` -> its UTF-8 bytes as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text; bytes that are not valid UTF-8 become U+FFFD. An id outside 0..255 raises."""
        try:
            data = bytes(ids)
        except ValueError:  # name the id: bytes() only says "not in range(0, 256)"
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is not a byte (the byte tokenizer's ids are 0..255)") from None
        return data.decode("utf-8", errors="replace")


class Decoder(Protocol):
    """What :class:`TextStream` needs of a tokenizer (a ``transformers`` tokenizer has it)."""

    def decode(self, ids: Sequence[int]) -> str: ...


class TextStream:
    """One request's text, emitted as its tokens arrive, cut at the first stop string.

    ``push(ids)`` returns the new text that is safe to emit; ``finish()`` returns what was held
    back once the request is over. Once a stop string appears, ``stopped`` is true, the text
    emitted in all is exactly the text before the first occurrence of the earliest stop string,
    and further pushes return "".

    Each push decodes all the ids so far and emits the part after the text already emitted:
    tokenizers merge bytes and whitespace across tokens, so decoding each token alone would
    not give the same text. Held back until a later token settles them: a trailing U+FFFD (an
    incomplete UTF-8 character) and the longest suffix that is the start of a stop string.
    (A tokenizer whose decode rewrites text already decoded, such as one cleaning up spaces
    before punctuation, is followed from the length already emitted.)
    """

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop={list(stop)!r}: every stop string must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._text = ""
        self._stopped = False
        self._finished = False

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string has appeared (the request should end)."""
        return self._stopped

    def push(self, token_ids: Sequence[int]) -> str:
        """Take the next tokens; return the text they make safe to emit (maybe "")."""
        if self._finished:
            raise RuntimeError("TextStream.push after finish(): the request is over")
        if self._stopped:
            return ""
        self._ids.extend(token_ids)
        return self._advance(self._tokenizer.decode(self._ids).rstrip(_INCOMPLETE), final=False)

    def finish(self) -> str:
        """The request is over: return the text held back (all of it, unless a stop string came)."""
        if self._finished or self._stopped:
            self._finished = True
            return ""
        self._finished = True
        return self._advance(self._tokenizer.decode(self._ids), final=True)

    def _advance(self, decoded: str, final: bool) -> str:
        """Emit what ``decoded`` (the text of every id so far) adds that is safe to emit."""
        start = len(self._text)
        stop_at = self._first_stop(decoded, start)
        if stop_at is not None:
            self._stopped = True
            end = stop_at
        else:
            end = len(decoded) if final else len(decoded) - self._held_for_stop(decoded, start)
        new = decoded[start:end]
        self._text += new
        return new

    def _first_stop(self, decoded: str, start: int) -> int | None:
        """Where the earliest stop string begins in ``decoded``, searching from ``start``: none
        can begin earlier, since a suffix that might start one is never emitted."""
        found = [at for at in (decoded.find(s, start) for s in self._stop) if at >= 0]
        return min(found, default=None)

    def _held_for_stop(self, decoded: str, start: int) -> int:
        """The length of the longest suffix of ``decoded[start:]`` that a stop string begins with."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(decoded) - start), longest, -1):
                if decoded.endswith(stop[:length]):
                    longest = length
                    break
        return longest
