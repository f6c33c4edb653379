"""What a generation request asks for: the sampling parameters and their validation.

Shared by the engine (which samples with them), the HTTP server (which builds them from an
OpenAI request) and ``tessera generate``. A bad value raises ValueError naming the field and
what is allowed; the server turns that into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it ends.

    ``temperature=0`` is greedy decoding (top-k/top-p are then ignored). ``seed`` makes a
    sampled request reproducible on its own, whatever else shares the batch (each request
    draws from a generator of its own). ``stop`` strings end the request when its text
    contains one (the text up to it is returned); ``stop_token_ids`` (such as the tokenizer's
    end-of-sequence id) end it on that token, which is not returned.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer of at least 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be at least 0 (0: greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer of at least 0 (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
