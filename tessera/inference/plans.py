"""What travels between the scheduler, the ranks and the server: a sequence's state on the
driver, each step's plan (:class:`StepPlan` of :class:`Row`), what the sampling rank chose
(:class:`StepResult`), and the news of each request (:class:`Output`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.inference.params import SamplingParams


@dataclass
class Sequence:
    """One sequence's state: its tokens (prompt then generated), its KV blocks, how many
    tokens are cached, and its request's bookkeeping."""

    request_id: str
    index: int  # its number among the request's n sequences
    prompt_len: int
    tokens: list[int]
    params: SamplingParams  # this sequence's own (n=1, its seed)
    arrival: int  # the request's place in the arrival order
    adapter: int = -1  # the served LoRA adapter it uses (-1: the base alone)
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # content keys of its full blocks, as far as known
    registered: int = 0  # its full blocks offered to the prefix cache
    cached: int = 0  # tokens whose keys and values are in the cache
    parent: Sequence | None = None  # set while it waits for its request's first sequence's prefill
    prompt_logprobs_next: int = 1  # the next prompt position whose logprob is owed (echo)
    finish_reason: str | None = None

    @property
    def seq_id(self) -> str:
        return f"{self.request_id}/{self.index}"

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.tokens) - self.cached

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_next < self.prompt_len


@dataclass(frozen=True)
class Sample:
    """A token to choose from a row's last logits, for sequence ``seq_id`` (``index`` of its
    request's ``n``), with its own parameters."""

    seq_id: str
    params: SamplingParams
    request_index: int  # the engine's running number of the request (unseeded requests differ)


@dataclass(frozen=True)
class Row:
    """One sequence's share of a step: ``tokens`` computed after ``past`` cached ones, over its
    block table; ``samples`` choose from the logits after its last token (none for a chunk
    that ends inside the prompt); ``prompt_logprobs`` (top-k, or None) asks for the prompt
    log-probabilities of the tokens after positions ``logprob_from ..`` of this chunk."""

    seq_id: str
    tokens: tuple[int, ...]
    past: int
    blocks: tuple[int, ...]
    adapter: int = -1
    samples: tuple[Sample, ...] = ()
    prompt_logprobs: int | None = None
    logprob_from: int = 0  # the first position (absolute) whose next token's logprob is reported
    logprob_to: int = 0  # one past the last such position
    after: int = -1  # the sequence's token after this chunk (-1: none yet), for the last position's logprob


@dataclass(frozen=True)
class StepPlan:
    """What every rank runs in one step (sent from rank 0 to all): ``copies`` of shared blocks
    first (copy-on-write: ``(source, destination)``), then the ``decode`` rows (one token each)
    and the ``prefill`` rows (prompt chunks), as two batches. ``kind``: "step", "idle" (nothing
    to run), "done" or "stop"; ``finished``: sequences ended since the last plan (the sampler
    drops their generators)."""

    kind: str
    decode: tuple[Row, ...] = ()
    prefill: tuple[Row, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    finished: tuple[str, ...] = ()

    @property
    def rows(self) -> tuple[Row, ...]:
        return self.decode + self.prefill

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@dataclass(frozen=True)
class Choice:
    """What the sampler chose for one sequence: the token, its log-probability and the
    ``top`` alternatives ``((token, logprob), ...)`` (empty unless asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """A step's choices by sequence id, and prompt log-probabilities by sequence id: for each
    position of the chunk, ``(token after it, its logprob, top alternatives)``."""

    choices: dict[str, Choice] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[int, float, tuple[tuple[int, float], ...]]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Output:
    """News of sequence ``index`` of a request: its new ``token`` (None when it ended without
    one: a stop token, which is ``sampled`` but not returned, or a prompt scored without
    generating), that token's ``logprob`` and ``top`` alternatives, the prompt's log-probabilities
    computed in this step (``prompt``: ``(token, logprob, top)`` per prompt token after the
    first), and when it ended, why ("stop", "length", or "error: ...")."""

    request_id: str
    token: int | None
    finish_reason: str | None
    index: int = 0
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    prompt: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()
    sampled: int | None = None
