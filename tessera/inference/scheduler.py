"""Continuous batching: which tokens each step computes, for which sequences, and what happens
to them after.

The scheduler lives on rank 0 and deals in token ids and block numbers only. A sequence is its
tokens (the prompt, then what it generated) and how many of them are in the KV cache; a step
computes the next ones. Every step has a budget of ``max_step_tokens`` tokens:

1. every running sequence that has only its last token to compute *decodes* it (one token each,
   oldest first). A decode that needs a new block when none is free *preempts* the newest
   sequence that holds blocks (its blocks go back; it waits at its place in the arrival order
   and is computed again later, its prompt and tokens so far as one prompt), or waits itself
   when it is the newest. No request reserves its ``max_tokens`` ahead.
2. what is left of the budget goes to *prefill chunks*, first come first served: sequences
   already part-way through their prompt, then newly admitted ones, each taking as many tokens
   as the budget and the free blocks allow. A long prompt is so split over several steps and
   never stalls the running streams for more than one chunk. The first waiting request that
   cannot start stops admission (no later request overtakes it), and preemption only ever
   takes from newer sequences, so no request waits for ever.

Prefix caching (:class:`~tessera.inference.blocks.BlockManager`): a new sequence first takes
the cached blocks its tokens begin with and computes only the rest (at least its last token,
whose logits it samples from). A request of ``n`` sequences prefills once: its other
sequences are forked from the first when the prompt is done, sharing its blocks, and sample
their first tokens from the same logits.
"""

from __future__ import annotations

import itertools

from tessera.inference.blocks import BlockManager, block_hash
from tessera.inference.params import SamplingParams
from tessera.inference.plans import Choice, Output, Row, Sample, Sequence, StepPlan, StepResult

__all__ = ["Choice", "Output", "Row", "Sample", "Scheduler", "Sequence", "StepPlan", "StepResult"]


class Scheduler:
    """Admission, step plans and bookkeeping for continuous batching over ``blocks`` (module
    docstring): at most ``max_batch`` sequences hold blocks at once, and a step computes at most
    ``max_step_tokens`` tokens (decodes never wait for it)."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_len: int,
        max_batch: int = 64,
        max_step_tokens: int = 512,
        adapters: int = 0,
    ) -> None:
        self.blocks = blocks
        self.max_len, self.max_batch, self.max_step_tokens = max_len, max_batch, max_step_tokens
        self.adapters = adapters  # served LoRA adapters: a request names one of 0 .. adapters-1, or -1
        self.waiting: list[Sequence] = []  # in arrival order (preempted ones back at their place)
        self.running: list[Sequence] = []  # holding blocks, in arrival order
        self.forks: dict[str, list[Sequence]] = {}  # request -> sequences waiting for its prefill
        self._requests: dict[str, int] = {}  # request id -> arrival number
        self._left: dict[str, int] = {}  # request id -> sequences not yet ended
        self._ended: list[str] = []
        self._arrivals = itertools.count()
        self.preemptions = 0
        self.last_step_tokens = 0

    @property
    def allocator(self) -> BlockManager:  # the name the engine's users read the gauges by
        return self.blocks

    # ---- requests ---------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams, adapter: int = -1) -> None:
        """Queue a request (``params.n`` sequences, with the served LoRA adapter ``adapter``, -1:
        none); raises ValueError when it could never run (empty, too long, too big for the
        whole cache, more sequences than a batch, no such adapter)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt) >= self.max_len and params.max_tokens > 0:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model holds {self.max_len} in all")
        if len(prompt) > self.max_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model holds {self.max_len}")
        if not -1 <= adapter < self.adapters:
            raise ValueError(f"adapter {adapter} does not exist: {self.adapters} adapters are served (-1: none)")
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} is more sequences than a batch holds ({self.max_batch})")
        longest = min(len(prompt) + params.max_tokens, self.max_len)
        if self.blocks.blocks_for(longest) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)}) plus max_tokens ({params.max_tokens}) needs "
                f"{self.blocks.blocks_for(longest)} KV blocks; the cache has {self.blocks.num_blocks}"
            )
        arrival = next(self._arrivals)
        seqs = [
            Sequence(request_id, j, len(prompt), list(prompt), params.for_sequence(j), arrival, adapter)
            for j in range(params.n)
        ]
        for child in seqs[1:]:
            child.parent = seqs[0]
        self._requests[request_id] = arrival
        self._left[request_id] = params.n
        self.waiting.append(seqs[0])
        if params.n > 1:
            self.forks[request_id] = seqs[1:]

    def abort(self, request_id: str) -> bool:
        """Drop a request's waiting and running sequences, freeing their blocks; False when unknown."""
        if request_id not in self._requests:
            return False
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.running.remove(seq)
            self._release(seq)
        self.waiting = [s for s in self.waiting if s.request_id != request_id]
        self.forks.pop(request_id, None)
        self._forget(request_id)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued(self) -> int:
        """Sequences waiting for blocks: new requests, and preempted sequences to compute again."""
        return len(self.waiting)

    # ---- steps ------------------------------------------------------------------------------
    def next_plan(self) -> StepPlan:
        """The next step (module docstring), or idle."""
        copies: list[tuple[int, int]] = []
        decode = self._decodes(copies)
        budget = self.max_step_tokens - len(decode)
        prefill = self._prefills(budget, copies) if budget > 0 else []
        if not decode and not prefill:
            self.last_step_tokens = 0
            return StepPlan("idle", finished=self._take_ended())
        plan = StepPlan("step", tuple(decode), tuple(prefill), tuple(copies), self._take_ended())
        self.last_step_tokens = plan.tokens
        return plan

    def _decodes(self, copies: list[tuple[int, int]]) -> list[Row]:
        rows: list[Row] = []
        decoding = [s for s in self.running if s.pending == 1 and s.parent is None]
        done: set[int] = set()
        for seq in decoding:
            if id(seq) in done or seq not in self.running:  # preempted meanwhile
                continue
            if not self._room_for(seq, 1, copies):
                continue  # it was the newest: preempted itself
            rows.append(self._row(seq, 1))
            done.add(id(seq))
        return rows

    def _room_for(self, seq: Sequence, count: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks of its own for ``seq``'s next ``count`` tokens (a new block past its end, or its
        shared last block copied), preempting newer sequences as needed; False when ``seq``
        itself had to go (it was the newest)."""
        size = self.blocks.block_size
        while True:
            index = seq.cached // size  # the block its next token goes to
            shared = index < len(seq.blocks) and self.blocks.refs(seq.blocks[index]) > 1
            need = self.blocks.blocks_for(seq.cached + count) - len(seq.blocks) + int(shared)
            if need <= self.blocks.free:
                break
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if shared:
            copied = self.blocks.writable(seq.blocks, index)
            if copied is not None:
                copies.append(copied)
        more = self.blocks.blocks_for(seq.cached + count) - len(seq.blocks)
        if more > 0:
            seq.blocks += self.blocks.allocate_many(more)
        return True

    def _prefills(self, budget: int, copies: list[tuple[int, int]]) -> list[Row]:
        rows: list[Row] = []
        # part-way through their prompt first (they hold blocks), then the waiting, in arrival order
        started = [s for s in self.running if s.pending > 1]
        for seq in started:
            if budget <= 0:
                return rows
            chunk = self._chunk(seq, budget)
            if chunk == 0:
                continue
            rows.append(self._row(seq, chunk))
            budget -= chunk
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            forks = len(self.forks.get(seq.request_id, ())) if seq.index == 0 and seq.parent is None else 0
            if len(self.running) + 1 + forks > self.max_batch:
                break
            self._start(seq)
            chunk = self._chunk(seq, budget)
            if chunk == 0:  # no blocks for it now: it waits, and so does everyone after it
                self._unstart(seq)
                break
            self.waiting.pop(0)
            self._insert_running(seq)
            rows.append(self._row(seq, chunk))
            budget -= chunk
        return rows

    def _start(self, seq: Sequence) -> None:
        """Take the cached blocks ``seq``'s tokens begin with (prefix caching): at most all but its
        last token, and none it owes prompt logprobs after (their logits are needed)."""
        limit = len(seq.tokens) - 1
        if seq.wants_prompt_logprobs:
            limit = min(limit, seq.prompt_logprobs_next - 1)
        found, keys = self.blocks.match(seq.tokens, seq.adapter, limit)
        seq.blocks, seq.keys = found, keys
        seq.cached = len(found) * self.blocks.block_size
        seq.registered = len(found)

    def _unstart(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks, seq.cached, seq.registered = [], 0, 0

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s pending tokens this step computes: the budget and the free
        blocks allow (taking those blocks)."""
        size = self.blocks.block_size
        chunk = min(seq.pending, budget)
        room = (len(seq.blocks) * size - seq.cached) + self.blocks.free * size
        chunk = min(chunk, room)
        if chunk <= 0:
            return 0
        need = self.blocks.blocks_for(seq.cached + chunk) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.blocks.allocate_many(need)
        return chunk

    def _row(self, seq: Sequence, count: int) -> Row:
        end = seq.cached + count
        samples: tuple[Sample, ...] = ()
        if end == len(seq.tokens) and not (seq.params.max_tokens == 0 and len(seq.tokens) == seq.prompt_len):
            group = [seq, *self.forks.get(seq.request_id, ())] if seq.index == 0 and seq.parent is None else [seq]
            arrival = self._requests[seq.request_id]
            samples = tuple(Sample(s.seq_id, s.params, arrival * 64 + s.index) for s in group if s is seq or s.parent)
        lp_from = lp_to = 0
        top = None
        if seq.wants_prompt_logprobs:
            lp_from = max(seq.cached, seq.prompt_logprobs_next - 1)
            lp_to = min(end, seq.prompt_len - 1)
            if lp_to > lp_from:
                top = seq.params.prompt_logprobs
        return Row(
            seq.seq_id,
            tuple(seq.tokens[seq.cached : end]),
            seq.cached,
            tuple(seq.blocks),
            seq.adapter,
            samples,
            top,
            lp_from,
            lp_to if top is not None else lp_from,
            seq.tokens[end] if end < len(seq.tokens) else -1,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks; it waits at its place in the arrival order, to be computed
        again from its tokens so far (its full blocks may still be in the prefix cache)."""
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks, seq.keys, seq.cached, seq.registered = [], [], 0, 0
        place = next((i for i, s in enumerate(self.waiting) if (s.arrival, s.index) > (seq.arrival, seq.index)), None)
        self.waiting.insert(len(self.waiting) if place is None else place, seq)
        self.preemptions += 1

    def _insert_running(self, seq: Sequence) -> None:
        place = next((i for i, s in enumerate(self.running) if (s.arrival, s.index) > (seq.arrival, seq.index)), None)
        self.running.insert(len(self.running) if place is None else place, seq)

    # ---- after a step -----------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Output]:
        """Record what the step computed and chose: the cached counts, the prefix cache's new
        full blocks, the forks of an ``n`` request, each sequence's new token, and the ends (a
        stop token, which is not returned; ``max_tokens``; the model's length)."""
        outputs: list[Output] = []
        by_id = {s.seq_id: s for s in self.running}
        for row in plan.rows:
            seq = by_id.get(row.seq_id)
            if seq is None:  # aborted during the step
                continue
            seq.cached = row.past + len(row.tokens)
            self._register(seq)
            prompt = tuple(result.prompt_logprobs.get(row.seq_id, ()))
            if prompt:
                seq.prompt_logprobs_next = row.logprob_to + 1
            if not row.samples:
                if seq.params.max_tokens == 0 and seq.cached == len(seq.tokens):  # a prompt scored
                    outputs.append(self._finish(seq, None, "length", prompt=prompt))
                elif prompt:
                    outputs.append(Output(seq.request_id, None, None, seq.index, prompt=prompt))
                continue
            forked = self.forks.pop(seq.request_id, []) if seq.index == 0 else []
            for child in forked:  # the same prompt's blocks, shared
                child.parent = None
                child.blocks = self.blocks.share(seq.blocks)
                child.keys, child.registered, child.cached = list(seq.keys), seq.registered, seq.cached
                self._insert_running(child)
                by_id[child.seq_id] = child
            for sample in row.samples:
                target = by_id[sample.seq_id]
                outputs.append(self._record(target, result.choices[sample.seq_id], prompt if target is seq else ()))
        return outputs

    def _record(self, seq: Sequence, choice: Choice, prompt: tuple) -> Output:
        token = choice.token
        if token in seq.params.stop_token_ids:
            return self._finish(seq, None, "stop", choice, prompt)
        seq.tokens.append(token)
        if len(seq.generated) >= seq.params.max_tokens or len(seq.tokens) >= self.max_len:
            return self._finish(seq, token, "length", choice, prompt)
        return Output(seq.request_id, token, None, seq.index, choice.logprob, choice.top, prompt, token)

    def _register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full blocks to the prefix cache."""
        size = self.blocks.block_size
        full = min(seq.cached // size, len(seq.blocks))
        while len(seq.keys) < full:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else None
            seq.keys.append(block_hash(parent, seq.tokens[i * size : (i + 1) * size], seq.adapter))
        while seq.registered < full:
            self.blocks.register(seq.blocks[seq.registered], seq.keys[seq.registered])
            seq.registered += 1

    def _finish(
        self, seq: Sequence, token: int | None, reason: str, choice: Choice | None = None, prompt: tuple = ()
    ) -> Output:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        self._left[seq.request_id] -= 1
        if self._left[seq.request_id] == 0:
            self._forget(seq.request_id)
        return Output(
            seq.request_id,
            token,
            reason,
            seq.index,
            choice.logprob if choice is not None else None,
            choice.top if choice is not None else (),
            prompt,
            choice.token if choice is not None else None,
        )

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks = []
        self._ended.append(seq.seq_id)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._left.pop(request_id, None)

    def _take_ended(self) -> tuple[str, ...]:
        ended, self._ended = tuple(self._ended), []
        return ended

    # ---- gauges -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "running": float(len(self.running)),
            "waiting": float(self.queued),
            "kv_blocks_used": float(self.blocks.used),
            "kv_blocks_total": float(self.blocks.num_blocks),
            "prefix_cache_hit_blocks": float(self.blocks.hit_blocks),
            "prefix_cache_queried_blocks": float(self.blocks.queried_blocks),
            "prefix_cache_hit_rate": self.blocks.hit_rate,
            "preemptions": float(self.preemptions),
            "step_tokens": float(self.last_step_tokens),
        }
