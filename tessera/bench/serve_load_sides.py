"""The sides of ``tessera bench serve --workload``: each an async context manager that starts a
server on the model and yields a :class:`Side`, which streams one request's greedy tokens. The
client code that drives them (``tessera.bench.serve_load``) is the same for all.

- :func:`tessera_server`: the real server (one rank), over HTTP: streamed ``/v1/completions``
  with token-id prompts, its text turned back into ids (token ``i`` is the word ``t<i>``).
- :func:`hf_static_batches`: ``model.generate`` of transformers in static batches, as a server
  without continuous batching runs it: whenever idle, a worker thread takes up to ``max_batch``
  waiting requests, pads them on the left and generates the longest ``max_tokens`` of the batch
  for all; each request gets its tokens as the steps make them and ends at its own
  ``max_tokens`` (the batch's later steps are waste for it).
- :func:`hf_continuous_batches`: transformers' own continuous batching
  (``model.init_continuous_batching``, its ``ContinuousBatchingManager``) with streamed results.

The two transformers sides run in this process (no HTTP); tessera's answers cross HTTP and are
detokenized and parsed, so any overhead of that path counts against tessera.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

TESSERA = "tessera serve"
HF_STATIC = "HF static"
HF_CB = "HF CB"


class Side(Protocol):
    def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        """The greedy tokens of ``prompt``, as they come (one or more per yield), ``max_tokens`` in all."""
        ...


class Sizes(Protocol):
    """What the sides take from the workload (``serve_load.LoadWorkload``)."""

    @property
    def vocab(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def kv_blocks(self) -> int: ...


# ---- tessera: the real server over HTTP -----------------------------------------------------------
def ids_of(text: str) -> list[int]:
    """The token ids of text of the bench's word-level tokenizer (``"t5 t17"`` -> ``[5, 17]``)."""
    return [int(word[1:]) for word in text.split()]


@dataclass
class ServerClient:
    """Streamed ``/v1/completions`` against the server at ``client``'s base URL."""

    client: Any  # httpx.AsyncClient

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        from tessera.bench.serve import completion_events

        sent = 0
        counted = None
        async for data in completion_events(self.client, prompt, max_tokens):
            if data["choices"] and data["choices"][0]["text"]:
                ids = ids_of(data["choices"][0]["text"])
                sent += len(ids)
                yield ids
            if data.get("usage"):
                counted = int(data["usage"]["completion_tokens"])
        if counted != sent:
            raise RuntimeError(f"the server streamed the text of {sent} tokens and counted {counted}")


@asynccontextmanager
async def tessera_server(model: torch.nn.Module, w: Sizes) -> AsyncIterator[Side]:
    """The real server on ``model``: a :class:`~tessera.serve.ranks.RankBackend` of one rank
    (``w.max_batch`` running sequences, ``w.kv_blocks`` KV blocks of ``w.block_size`` tokens, so
    every request is admitted as soon as a batch slot is free), no request limit in the way."""
    import httpx

    from tessera.bench.serve import served
    from tessera.serve.app import Limits
    from tessera.serve.ranks import EngineOptions

    options = EngineOptions(
        num_blocks=w.kv_blocks, block_size=w.block_size, max_batch=w.max_batch, max_prefill_tokens=w.max_prefill_tokens
    )
    limits = Limits(max_prompt_tokens=w.context, max_tokens=w.context, max_concurrent_requests=w.requests + 1)
    with served(model, w.vocab, options, limits, w.threads) as url:
        connections = httpx.Limits(max_connections=w.requests + 1)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=connections) as client:
            yield ServerClient(client)


# ---- in-process servers over transformers -------------------------------------------------------
_END = object()  # a request's last item: its tokens are all delivered


class _Answers:
    """One request's queue on the client's event loop; ``deliver`` may be called from any thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(self, item: Any) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def tokens(self) -> AsyncIterator[list[int]]:
        while (item := await self._items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass
class _Job:
    prompt: list[int]
    max_tokens: int
    answers: _Answers


class _BatchSteps:
    """A ``generate`` streamer for a batch: ``put`` gets the prompts, then each step's new token of
    every row; row ``i`` gets its tokens up to its own ``max_tokens`` and then its end."""

    def __init__(self, jobs: list[_Job]) -> None:
        self.jobs = jobs
        self.step = -1  # the first put is the prompts

    def put(self, value: torch.Tensor) -> None:
        self.step += 1
        if self.step == 0:
            return
        for job, token in zip(self.jobs, value.tolist(), strict=True):
            if self.step <= job.max_tokens:
                job.answers.deliver([token])
                if self.step == job.max_tokens:
                    job.answers.deliver(_END)

    def end(self) -> None:
        pass


class StaticBatches:
    """``model.generate`` in static batches of up to ``max_batch`` waiting requests, on a worker thread."""

    def __init__(self, model: torch.nn.Module, max_batch: int, pad_id: int = 0) -> None:
        self.model, self.max_batch, self.pad_id = model, max_batch, pad_id
        self._waiting: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="bench-hf-static", daemon=True)
        self._worker.start()

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        answers = _Answers()
        self._waiting.put(_Job(prompt, max_tokens, answers))
        async for tokens in answers.tokens():
            yield tokens

    def close(self) -> None:
        self._waiting.put(None)
        self._worker.join()

    def _serve(self) -> None:
        while (job := self._waiting.get()) is not None:
            batch = [job]
            while len(batch) < self.max_batch:
                try:
                    more = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._waiting.put(None)  # stop after this batch
                    break
                batch.append(more)
            try:
                self._generate(batch)
            except Exception as error:  # every request of the batch fails with it (those done ignore it)
                for failed in batch:
                    failed.answers.deliver(error)

    def _generate(self, batch: list[_Job]) -> None:
        """Left padding and its attention mask (generate numbers the positions from the mask)."""
        longest = max(len(job.prompt) for job in batch)
        ids = torch.tensor([[self.pad_id] * (longest - len(job.prompt)) + job.prompt for job in batch])
        mask = torch.tensor([[0] * (longest - len(job.prompt)) + [1] * len(job.prompt) for job in batch])
        with torch.no_grad():
            self.model.generate(  # type: ignore[operator]
                input_ids=ids, attention_mask=mask, max_new_tokens=max(job.max_tokens for job in batch),
                do_sample=False, eos_token_id=None, pad_token_id=self.pad_id, streamer=_BatchSteps(batch),
            )  # fmt: skip


@asynccontextmanager
async def hf_static_batches(model: torch.nn.Module, w: Sizes) -> AsyncIterator[Side]:
    batches = StaticBatches(model, w.max_batch)
    try:
        yield batches
    finally:
        batches.close()


class ContinuousBatches:
    """transformers' continuous batching manager, streaming each request's tokens."""

    def __init__(self, model: torch.nn.Module, w: Sizes) -> None:
        import transformers

        config = transformers.ContinuousBatchingConfig(
            page_size=w.block_size, num_blocks=w.kv_blocks, max_batch_tokens=w.max_prefill_tokens,
            max_requests_per_batch=w.max_batch,
        )  # fmt: skip
        # eos -1: none (the manager's own value for "not set", without its warning)
        generation = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.manager = model.init_continuous_batching(  # type: ignore[operator]
            generation_config=generation, continuous_batching_config=config
        )
        self.manager.start()
        self._ids = itertools.count()

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        answers: asyncio.Queue[Any] = asyncio.Queue()
        request_id = f"bench-{next(self._ids)}"
        self.manager.register_result_handler(request_id, answers.put_nowait)  # before the request: no race
        if self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=True) is None:
            raise RuntimeError("transformers' continuous batching manager refused a request (see its log)")
        sent = 0
        while True:
            out = await answers.get()
            if out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {out.error}")
            new = list(out.generated_tokens[sent:])
            sent += len(new)
            if new:
                yield new
            if out.is_finished():
                return

    def close(self) -> None:
        self.manager.stop(block=True, timeout=60)
        self.manager.destroy()


@asynccontextmanager
async def hf_continuous_batches(model: torch.nn.Module, w: Sizes) -> AsyncIterator[Side]:
    batches = ContinuousBatches(copy.deepcopy(model), w)  # the manager switches the model's attention
    try:
        yield batches
    finally:
        batches.close()


SIDES: dict[str, Callable[[torch.nn.Module, Sizes], Any]] = {
    TESSERA: tessera_server,
    HF_STATIC: hf_static_batches,
    HF_CB: hf_continuous_batches,
}
