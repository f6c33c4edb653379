"""What a generation request asks for: the sampling parameters and their validation.

Shared by the engine (which samples with them), the HTTP server (which builds them from an
OpenAI request) and ``tessera generate``. A bad value raises ValueError naming the field and
what is allowed; the server turns that into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per position (OpenAI's and vLLM's cap)
MAX_N = 16  # the most sequences one request may ask for


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen, what it reports and when it ends.

    ``temperature=0`` is greedy decoding (top-k/top-p are then ignored). ``seed`` makes a
    sampled request reproducible on its own, whatever else shares the batch (each sequence
    draws from a generator of its own; with ``n`` sequences, sequence ``j`` uses ``seed + j``, so
    each equals a request of ``n=1`` with that seed). ``stop`` strings end the request when its
    text contains one (the text up to it is returned); ``stop_token_ids`` (such as the
    tokenizer's end-of-sequence id) end it on that token, which is not returned.

    ``n``: sequences generated from one prompt (one prefill; their KV blocks shared until they
    differ). ``logprobs``: None, or how many most likely alternatives to report beside each
    sampled token's own log-probability (0: the sampled token's alone); ``prompt_logprobs``
    likewise for every prompt token after the first (OpenAI's ``echo``). Log-probabilities are
    of the model's distribution (a log-softmax of its logits), before penalties, bias and
    temperature. ``max_tokens=0`` generates nothing: it scores the prompt (``prompt_logprobs``
    must be set). ``presence_penalty``/``frequency_penalty`` (OpenAI's, in [-2, 2]) lower the
    logits of tokens already generated, once or per occurrence; ``logit_bias`` adds a bias in
    [-100, 100] to the logits of the token ids it names.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer of at least 1 (0 to score a prompt)")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens=0 must be an integer of at least 1 (0 only scores a prompt: set prompt_logprobs)"
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} must be at least 0 (0: greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer of at least 0 (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n={self.n!r} must be an integer from 1 to {MAX_N}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be an integer from 0 to {MAX_LOGPROBS} (or None: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [-2, 2]")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty string")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        for token, value in bias:
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"logit_bias: token {token} with bias {value}: ids are at least 0, biases in [-100, 100]"
                )
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties or a bias change the logits before choosing."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def for_sequence(self, index: int) -> SamplingParams:
        """The parameters of sequence ``index`` of ``n``: one sequence, the seed ``seed + index``."""
        if self.n == 1 and index == 0:
            return self
        from dataclasses import replace

        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)
