"""The generation engine: every rank runs the same steps over its part of the model.

Rank 0 drives. It holds the :class:`~tessera.inference.scheduler.Scheduler` (requests, block
tables) and sends each step's :class:`~tessera.inference.scheduler.StepPlan` to every rank; the
other ranks follow the plans they receive. In a step the first pipeline stage embeds the new
tokens, each stage runs its layers over the paged KV cache and passes the hidden states on, the
last stage's logits are sampled by its first tensor rank (which keeps each request's random
generator), and the chosen tokens are broadcast so rank 0 can record them.

``generate`` runs a list of prompts to the end (every rank calls it, as with any collective);
``serve`` is rank 0's loop behind the HTTP server, taking requests from a channel between steps
(continuous batching) while the other ranks ``follow``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.comm import broadcast_object, recv, send
from tessera.context import ParallelContext
from tessera.inference.blocks import BlockManager
from tessera.inference.cache import KVPool, StepBatch
from tessera.inference.models import Runner
from tessera.inference.params import SamplingParams
from tessera.inference.sampling import request_generator, sample, shaped, top_logprobs
from tessera.inference.scheduler import Choice, Output, Row, Sample, Scheduler, StepPlan, StepResult

HEARTBEAT_S = 1.0  # an idle driver still sends a plan this often, so followers never time out


@dataclass(frozen=True)
class CacheOptions:
    """The KV cache and batch limits: ``num_blocks`` blocks of ``block_size`` token slots per
    layer (every rank the same count, each for its own heads and layers), at most ``max_batch``
    sequences holding blocks, at most ``max_prefill_tokens`` tokens computed per step (decodes
    and prompt chunks together: a longer prompt is prefilled in chunks), and prefix caching of
    full blocks (``prefix_caching``)."""

    num_blocks: int = 256
    block_size: int = 16
    max_batch: int = 32
    max_prefill_tokens: int = 512
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_batch", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass(frozen=True)
class Result:
    """A finished request: its generated tokens and why it ended ("stop" or "length"); the
    tokens as sampled (a stop token too) and their log-probabilities."""

    tokens: list[int]
    finish_reason: str
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class InferenceEngine:
    """Generation over this rank's :class:`~tessera.inference.models.Runner` (collective: every
    rank of ``ctx`` builds one and takes part in every step)."""

    def __init__(self, runner: Runner, ctx: ParallelContext, options: CacheOptions | None = None) -> None:
        self.runner, self.ctx = runner, ctx
        self.options = options or CacheOptions()
        self.pool = KVPool(self.options.num_blocks, self.options.block_size, ctx.device)
        self.world, self.pipeline = ctx.group("world"), ctx.group("pipeline")
        self.driver = ctx.rank == 0
        self.stage = ctx.local_rank("pipeline")
        self.sampler = self.world.size - ctx.size("tensor")  # the last stage's first tensor rank
        self.samples = ctx.rank == self.sampler
        self.scheduler: Scheduler | None = None
        routing = getattr(runner, "routing", None)  # a runner of its own (rlhf's tap) may serve no adapters
        if self.driver:
            blocks = BlockManager(self.options.num_blocks, self.options.block_size, self.options.prefix_caching)
            self.scheduler = Scheduler(
                blocks,
                max_len=runner.max_len,
                max_batch=self.options.max_batch,
                max_step_tokens=self.options.max_prefill_tokens,
                adapters=routing.count if routing is not None else 0,
            )
        self._generators: dict[str, torch.Generator | None] = {}
        self._history: dict[str, list[int]] = {}  # tokens each sequence chose (penalties), on the sampler
        self.steps = 0

    # ---- one step, on every rank ------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` on this rank's stage: the copies, then the decode rows and the prefill
        rows as two batches; every rank returns the step's choices (and prompt log-probabilities).
        Under ``torch.inference_mode``: no op of the step keeps autograd's version counters or
        views (about 4% of a small model's decode step on a CPU)."""
        self._forget(plan.finished)
        self.pool.copy_blocks(plan.copies, self.options.block_size)
        result = StepResult()
        for rows in (plan.decode, plan.prefill):
            if rows:
                logits = self._forward(rows)
                if self.samples:
                    self._choose(rows, logits, result)
        if self.world.size > 1 and self.sampler != 0:
            result = broadcast_object(result if self.samples else None, self.world, src=self.sampler)
        self.steps += 1
        return result

    def _forward(self, rows: Sequence[Row]) -> torch.Tensor | None:
        """One batch through this stage; the logits on the last stage: each row's last
        position, then (for rows owing prompt log-probabilities) every position asked for."""
        echo = any(r.prompt_logprobs is not None for r in rows)
        positions = [self._positions(r) for r in rows] if echo else None
        batch = StepBatch.build(
            [r.tokens for r in rows],
            [r.past for r in rows],
            [r.blocks for r in rows],
            self.options.block_size,
            self.pool,
            [r.adapter for r in rows],
            positions,
        )
        hidden = None
        if not self.runner.first:
            shape = (*batch.tokens.shape, self.runner.hidden_size)
            hidden = recv(
                torch.empty(shape, dtype=self.runner.dtype, device=self.ctx.device), self.pipeline, self.stage - 1
            )
        out = self.runner.forward(batch, hidden)
        if not self.runner.last:
            send(out.contiguous(), self.pipeline, self.stage + 1)
            return None
        return out

    @staticmethod
    def _positions(row: Row) -> list[int]:
        last = row.past + len(row.tokens) - 1
        return [last, *range(row.logprob_from, row.logprob_to)] if row.prompt_logprobs is not None else [last]

    def _choose(self, rows: Sequence[Row], logits: torch.Tensor | None, result: StepResult) -> None:
        """On the sampler: each row's samples from its last logits, each with its log-probability
        (and top alternatives when asked), and the prompt log-probabilities rows owe."""
        assert logits is not None
        echo = any(r.prompt_logprobs is not None for r in rows)
        at = 0
        wanted: list[tuple[torch.Tensor, Sample]] = []
        for row in rows:
            last = logits[at]
            if echo:
                count = len(self._positions(row))
                if row.prompt_logprobs is not None:
                    self._prompt_logprobs(row, logits[at + 1 : at + count], result)
                at += count
            else:
                at += 1
            wanted += [(last, chosen) for chosen in row.samples]
        if not wanted:
            return
        raw = torch.stack([row for row, _ in wanted])
        rows_shaped = torch.stack([shaped(row, s.params, self._history.get(s.seq_id, ())) for row, s in wanted])
        tokens = sample(rows_shaped, [s.params for _, s in wanted], [self._generator(s) for _, s in wanted])
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        chosen = logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0].tolist()
        for i, ((_, s), token, logprob) in enumerate(zip(wanted, tokens.tolist(), chosen, strict=True)):
            top = top_logprobs(logprobs[i], s.params.logprobs) if s.params.logprobs else ()
            result.choices[s.seq_id] = Choice(int(token), float(logprob), top)
            self._history.setdefault(s.seq_id, []).append(int(token))

    @staticmethod
    def _prompt_logprobs(row: Row, logits: torch.Tensor, result: StepResult) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        following = [*row.tokens, row.after]  # the token after each position of the chunk
        entries = []
        for k, p in enumerate(range(row.logprob_from, row.logprob_to)):
            token = following[p + 1 - row.past]
            entries.append((token, float(logprobs[k, token]), top_logprobs(logprobs[k], row.prompt_logprobs or 0)))
        result.prompt_logprobs[row.seq_id] = entries

    def _generator(self, s: Sample) -> torch.Generator | None:
        if s.seq_id not in self._generators:
            self._generators[s.seq_id] = request_generator(s.params, s.request_index)
        return self._generators[s.seq_id]

    def _forget(self, finished: Sequence[str]) -> None:
        """Drop the generators and histories of sequences that ended."""
        for seq_id in finished:
            self._generators.pop(seq_id, None)
            self._history.pop(seq_id, None)

    # ---- rank 0 -------------------------------------------------------------------------------
    def _scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("only rank 0 takes requests: the other ranks follow its plans")
        return self.scheduler

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams, adapter: int = -1) -> None:
        """Queue a request; ``adapter``: the served LoRA adapter it uses (-1: the base alone)."""
        self._scheduler().add(request_id, list(prompt), params, adapter)

    def abort(self, request_id: str) -> bool:
        return self._scheduler().abort(request_id)

    def step(self) -> list[Output]:
        """Rank 0: plan a step, send it to every rank, run it and return the outputs."""
        scheduler = self._scheduler()
        plan = scheduler.next_plan()
        self._send(plan)
        if plan.kind == "idle":
            return []
        return scheduler.update(plan, self.run(plan))

    def _send(self, plan: StepPlan) -> None:
        if self.world.size > 1:
            broadcast_object(plan, self.world, src=0)

    def finish(self, kind: str = "done") -> None:
        """Rank 0: end the followers' loop (``"done"``: a ``generate`` call; ``"stop"``: serving)."""
        self._send(StepPlan(kind))

    @property
    def kv_blocks_used(self) -> int:
        return self._scheduler().allocator.used

    # ---- the other ranks ----------------------------------------------------------------------
    def follow(self) -> str:
        """Run rank 0's plans until it says "done" or "stop"; returns which."""
        while True:
            plan: StepPlan = broadcast_object(None, self.world, src=0)
            if plan.kind in ("done", "stop"):
                return plan.kind
            if plan.kind == "idle":
                self._forget(plan.finished)
                continue
            self.run(plan)

    # ---- whole runs ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        arrivals: Sequence[int] | None = None,
        adapters: Sequence[int] | None = None,
    ) -> list[Result]:
        """Generate for every prompt (collective: every rank calls it with the same arguments and
        gets the results). ``arrivals[i]``: the step before which request ``i`` joins (default 0:
        all at once), to exercise continuous batching; ``adapters[i]``: the served LoRA adapter
        of prompt ``i`` (default: -1, the base alone)."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(each)} sampling parameters")
        if any(p.n != 1 for p in each):
            raise ValueError("generate() makes one sequence per prompt (n=1); add_request() and step() take n > 1")
        chosen = list(adapters) if adapters is not None else [-1] * len(prompts)
        if len(chosen) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(chosen)} adapters")
        results: list[Result | None] = [None] * len(prompts)
        if self.driver:
            starts = list(arrivals) if arrivals is not None else [0] * len(prompts)
            self._drive(prompts, each, starts, chosen, results)
            self.finish("done")
        else:
            self.follow()
        if self.world.size > 1:
            results = broadcast_object(results if self.driver else None, self.world, src=0)
        return [r for r in results if r is not None]

    def _drive(
        self,
        prompts: Sequence[Sequence[int]],
        params: list[SamplingParams],
        arrivals: list[int],
        adapters: list[int],
        results: list[Result | None],
    ) -> None:
        scheduler = self._scheduler()
        ids = [f"generate-{i}" for i in range(len(prompts))]
        index = {request_id: i for i, request_id in enumerate(ids)}
        made: dict[str, list[int]] = {request_id: [] for request_id in ids}
        sampled: dict[str, list[int]] = {request_id: [] for request_id in ids}
        logprobs: dict[str, list[float]] = {request_id: [] for request_id in ids}
        order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        step, next_new = 0, 0
        while next_new < len(order) or scheduler.has_work:
            while next_new < len(order) and arrivals[order[next_new]] <= step:
                i = order[next_new]
                try:
                    scheduler.add(ids[i], list(prompts[i]), params[i], adapters[i])
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
                next_new += 1
            for out in self.step():
                if out.token is not None:
                    made[out.request_id].append(out.token)
                if out.sampled is not None and out.logprob is not None:
                    sampled[out.request_id].append(out.sampled)
                    logprobs[out.request_id].append(out.logprob)
                if out.finish_reason is not None:
                    rid = out.request_id
                    results[index[rid]] = Result(made[rid], out.finish_reason, sampled[rid], logprobs[rid])
            step += 1

    def serve(self, receive: Callable[[float], list[Any]], emit: Callable[[list[Output]], None]) -> None:
        """Rank 0's loop behind the server: ``receive(timeout)`` returns the messages that came
        in (``("add", id, prompt, params, adapter)``, ``("abort", id)``, ``("stop",)``), waiting up to
        ``timeout`` seconds when there is nothing to run; ``emit`` takes each step's outputs
        (possibly none: the caller reads the scheduler's gauges then).
        A request that cannot run is answered with an output whose finish reason is
        ``"error: <why>"``."""
        scheduler = self._scheduler()
        last_sent = time.monotonic()
        while True:
            timeout = 0.0 if scheduler.has_work else HEARTBEAT_S
            messages = receive(timeout)
            refused: list[Output] = []
            for message in messages:
                if message[0] == "stop":
                    self.finish("stop")
                    return
                if message[0] == "abort":
                    scheduler.abort(message[1])
                elif message[0] == "add":
                    _, request_id, prompt, params, adapter = message
                    try:
                        scheduler.add(request_id, list(prompt), params, adapter)
                    except ValueError as exc:
                        refused.append(Output(request_id, None, f"error: {exc}"))
            # one emit per pass: the step's outputs carry the refusals, and its gauges those of
            # the aborts just handled (fewer, larger messages to the server)
            if scheduler.has_work or time.monotonic() - last_sent >= HEARTBEAT_S:
                outputs = self.step()
                last_sent = time.monotonic()
                emit(refused + outputs)
            elif messages:
                emit(refused)
