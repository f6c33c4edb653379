"""Continuous batching: which sequences run in each step, and what happens to them after.

The scheduler lives on rank 0 and deals in token ids and block numbers only. Each step it either
*prefills* newly admitted requests (their whole prompts, batched) or *decodes* one token for
every running sequence; a request that arrives while others decode joins at the next step. A
request is admitted only when the free blocks, less those promised to running sequences, hold
its prompt plus ``max_tokens`` (capped by the model's length): a running sequence never waits
for memory and nothing is preempted. A finished or aborted sequence's blocks return at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tessera.inference.cache import BlockAllocator
from tessera.inference.params import SamplingParams


@dataclass
class Sequence:
    """One request's state: its prompt, the tokens generated so far and its KV blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in the cache
    budget: int = 0  # most tokens the sequence will ever hold (prompt + max_tokens, capped)
    adapter: int = -1  # the served LoRA adapter it uses (-1: the base alone)
    finish_reason: str | None = None


@dataclass(frozen=True)
class StepPlan:
    """What every rank runs in one step (sent from rank 0 to all): per sequence, its new tokens,
    how many it has cached and its block table; the sampling parameters travel for the rank
    that samples; ``adapters`` the served LoRA adapter of each sequence (-1: none). ``kind``:
    "prefill", "decode", "idle" (nothing to run) or "stop"."""

    kind: str
    request_ids: tuple[str, ...] = ()
    new_tokens: tuple[tuple[int, ...], ...] = ()
    past: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    params: tuple[SamplingParams, ...] = ()
    adapters: tuple[int, ...] = ()
    finished: tuple[str, ...] = ()  # requests ended since the last plan (the sampler drops their generators)


@dataclass(frozen=True)
class Output:
    """A request's new token (None when it ended without one) and, when it ended, why."""

    request_id: str
    token: int | None
    finish_reason: str | None


class Scheduler:
    """Admission, step plans and bookkeeping for continuous batching over ``allocator``'s blocks."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_len: int,
        max_batch: int = 64,
        max_prefill_tokens: int = 4096,
        adapters: int = 0,
    ) -> None:
        self.allocator = allocator
        self.max_len, self.max_batch, self.max_prefill_tokens = max_len, max_batch, max_prefill_tokens
        self.adapters = adapters  # served LoRA adapters: a request names one of 0 .. adapters-1, or -1
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._ended: list[str] = []

    # ---- requests ---------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams, adapter: int = -1) -> None:
        """Queue a request (with the served LoRA adapter ``adapter``, -1: none); raises ValueError
        when it could never run (empty, too long, too big for the whole cache, no such adapter)."""
        if request_id in self.running or any(s.request_id == request_id for s in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt) >= self.max_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model holds {self.max_len} in all")
        if not -1 <= adapter < self.adapters:
            raise ValueError(f"adapter {adapter} does not exist: {self.adapters} adapters are served (-1: none)")
        seq = Sequence(request_id, list(prompt), params, adapter=adapter)
        seq.budget = min(len(prompt) + params.max_tokens, self.max_len)
        if self.allocator.blocks_for(seq.budget) > self.allocator.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)}) plus max_tokens ({params.max_tokens}) needs "
                f"{self.allocator.blocks_for(seq.budget)} KV blocks; the cache has {self.allocator.num_blocks}"
            )
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request, freeing its blocks; False when unknown."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        seq_or_none = self.running.pop(request_id, None)
        if seq_or_none is None:
            return False
        self._release(seq_or_none)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- steps ------------------------------------------------------------------------------
    def _promised(self) -> int:
        """Blocks the running sequences may still take."""
        return sum(self.allocator.blocks_for(s.budget) - len(s.blocks) for s in self.running.values())

    def _admit(self) -> list[Sequence]:
        if not self.waiting:
            return []
        admitted: list[Sequence] = []
        spare = self.allocator.free - self._promised()
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            need = self.allocator.blocks_for(seq.budget)
            if need > spare or (admitted and tokens + len(seq.prompt) > self.max_prefill_tokens):
                break
            self.waiting.popleft()
            spare -= need
            tokens += len(seq.prompt)
            admitted.append(seq)
        return admitted

    def next_plan(self) -> StepPlan:
        """The next step: a prefill of newly admitted requests when any fit, else a decode of
        every running sequence, else idle."""
        admitted = self._admit()
        if admitted:
            for seq in admitted:
                self.running[seq.request_id] = seq
            return self._plan("prefill", admitted, [seq.prompt for seq in admitted])
        if self.running:
            seqs = list(self.running.values())
            return self._plan("decode", seqs, [seq.generated[-1:] or seq.prompt[-1:] for seq in seqs])
        return StepPlan("idle", finished=self._take_ended())

    def _plan(self, kind: str, seqs: list[Sequence], new: list[list[int]]) -> StepPlan:
        for seq, tokens in zip(seqs, new):
            total = seq.cached + len(tokens)
            more = self.allocator.blocks_for(total) - len(seq.blocks)
            if more > 0:
                seq.blocks += self.allocator.allocate(more)
        return StepPlan(
            kind,
            request_ids=tuple(s.request_id for s in seqs),
            new_tokens=tuple(map(tuple, new)),
            past=tuple(s.cached for s in seqs),
            block_tables=tuple(tuple(s.blocks) for s in seqs),
            params=tuple(s.params for s in seqs),
            adapters=tuple(s.adapter for s in seqs) if any(s.adapter >= 0 for s in seqs) else (),
            finished=self._take_ended(),
        )

    def update(self, plan: StepPlan, tokens: list[int]) -> list[Output]:
        """Record the sampled ``tokens`` (one per sequence of ``plan``) and end the sequences
        that are done: a stop token (not returned), ``max_tokens`` or the model's length."""
        outputs: list[Output] = []
        for request_id, new, token in zip(plan.request_ids, plan.new_tokens, tokens):
            seq = self.running.get(request_id)
            if seq is None:  # aborted during the step
                continue
            seq.cached += len(new)
            if token in seq.params.stop_token_ids:
                outputs.append(self._finish(seq, None, "stop"))
                continue
            seq.generated.append(token)
            if len(seq.generated) >= seq.params.max_tokens or len(seq.prompt) + len(seq.generated) >= self.max_len:
                outputs.append(self._finish(seq, token, "length"))
            else:
                outputs.append(Output(request_id, token, None))
        return outputs

    def _finish(self, seq: Sequence, token: int | None, reason: str) -> Output:
        seq.finish_reason = reason
        del self.running[seq.request_id]
        self._release(seq)
        return Output(seq.request_id, token, reason)

    def _release(self, seq: Sequence) -> None:
        self.allocator.release(seq.blocks)
        seq.blocks = []
        self._ended.append(seq.request_id)

    def _take_ended(self) -> tuple[str, ...]:
        ended, self._ended = tuple(self._ended), []
        return ended
