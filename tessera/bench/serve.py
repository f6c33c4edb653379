"""``tessera bench serve``: tessera's generation engine against Hugging Face ``generate`` on the
same model, and the OpenAI-compatible server under concurrent streaming clients, on CPU.
(``--workload``: the server under a realistic load, in ``tessera.bench.serve_load``.)

One process, one small random ``LlamaForCausalLM`` (grouped-query attention, float32; no
download), the same weights on every side:

- decode: greedy tokens per second at batch 1 and batch 16 (prompts of ``prompt`` random
  tokens, ``new_tokens`` new ones each, no end-of-sequence stop). tessera:
  :meth:`~tessera.inference.engine.InferenceEngine.generate` over the model laid out by
  :func:`~tessera.inference.models.prepare_model` (paged KV cache, continuous batching);
  anchor: ``model.generate`` of transformers on a copy of the model (its default cache,
  ``do_sample=False``, the batch with its attention mask). Both run on ``threads`` intra-op
  threads; after one warm-up run each they alternate ``repeats`` timed runs (ABAB, then BABA)
  and the value is ``batch * new_tokens`` over the median run. Both must give the same greedy
  tokens: a side that computes something else fails the run, since its time would mean nothing.
- serve: the real server (:class:`~tessera.serve.ranks.RankBackend` with one rank,
  :func:`~tessera.serve.app.create_app`, :func:`~tessera.serve.http.serving`) answering
  ``clients`` concurrent streamed ``/v1/completions`` requests (``httpx``, asyncio; token-id
  prompts, greedy, ``max_tokens=new_tokens``), ``rounds`` rounds after a warm-up. Time to first
  token is from sending a request to its first text; the rows give the median and the 90th
  percentile (nearest rank) over all requests, and tokens per second over each round's wall
  time (median round). The anchor is the same server with one client at a time (one request
  alone per round, interleaved with the concurrent rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.bench.checks import same_tokens
from tessera.bench.report import Row, print_rows, write_rows

TESSERA = "tessera engine"
HF_GENERATE = "HF generate"
ALONE = "1 client"


@dataclass(frozen=True)
class Workload:
    """The model (a ``LlamaForCausalLM`` of ``layers`` layers of width ``hidden``, ``heads`` query
    heads over ``kv_heads`` key/value heads, vocabulary ``vocab``), the requests (``prompt``
    tokens in, ``new_tokens`` out), the decode batches, and the clients of the server."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    prompt: int = 32
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 16)
    repeats: int = 11  # timed runs per side and batch, alternating
    clients: int = 8
    rounds: int = 4  # timed rounds of concurrent clients (and as many single requests)
    threads: int = 1  # intra-op threads of both sides (and of the server's rank)

    @property
    def tag(self) -> str:
        return f"llama h{self.hidden} l{self.layers} {self.prompt}+{self.new_tokens}"


def build_model(w: Workload) -> torch.nn.Module:
    """The plain transformers model every side runs (seeded: the same weights every time)."""
    return build_llama(w, positions=w.prompt + w.new_tokens + 32)


def build_llama(w: Any, positions: int) -> torch.nn.Module:
    """A random ``LlamaForCausalLM`` of ``w``'s shape (``vocab``, ``hidden``, ``layers``, ``heads``,
    ``kv_heads``, ``intermediate``) and ``positions`` positions, float32, seeded; no end-of-sequence
    token, so greedy generation runs to ``max_tokens`` on every side."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate, num_hidden_layers=w.layers,
        num_attention_heads=w.heads, num_key_value_heads=w.kv_heads, max_position_embeddings=positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prompts_of(w: Workload, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, w.vocab, (count, w.prompt), generator=g).tolist()


# ---- decode: the engine against HF generate ------------------------------------------------------
def tessera_side(model: torch.nn.Module, w: Workload) -> Callable[[list[list[int]]], list[list[int]]]:
    """Greedy generation with tessera's engine on a copy of ``model`` (one rank, no process group)."""
    from tessera.context import ParallelContext, ParallelDims
    from tessera.inference.engine import CacheOptions, InferenceEngine
    from tessera.inference.models import prepare_model
    from tessera.inference.params import SamplingParams

    ctx = ParallelContext(ParallelDims(world_size=1, data=1), device=torch.device("cpu"))
    runner = prepare_model(copy.deepcopy(model), ctx)
    blocks = max(w.batches) * -(-(w.prompt + w.new_tokens) // 16)
    engine = InferenceEngine(runner, ctx, CacheOptions(num_blocks=blocks, block_size=16, max_batch=max(w.batches)))
    params = SamplingParams(max_tokens=w.new_tokens, temperature=0.0)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        return [r.tokens for r in engine.generate(prompts, params)]

    return generate


def hf_side(model: torch.nn.Module, w: Workload) -> Callable[[list[list[int]]], list[list[int]]]:
    """transformers' greedy ``generate`` (its default cache; the prompts have one length, so the
    attention mask is all ones and nothing is padded)."""

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=w.new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    return generate


def time_decode(w: Workload, batch: int, sides: dict[str, Callable[[list[list[int]]], list[list[int]]]]) -> dict:
    """Per side: the seconds of each timed run of ``batch`` prompts, and the tokens of the warm-up."""
    prompts = prompts_of(w, batch)
    tokens = {name: generate(prompts) for name, generate in sides.items()}  # warm-up
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(w.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            sides[name](prompts)
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": seconds, "tokens": tokens}


def check_tokens(batch: int, tokens: dict[str, list[list[int]]]) -> None:
    """Raises unless tessera's greedy tokens are HF's, naming the first difference."""
    same_tokens(batch, tokens, TESSERA, HF_GENERATE)


def decode_rows(w: Workload, batch: int, seconds: dict[str, list[float]]) -> list[Row]:
    made = batch * w.new_tokens
    ours, theirs = statistics.median(seconds[TESSERA]), statistics.median(seconds[HF_GENERATE])
    return [Row(f"decode {w.tag} b{batch}", "tokens_per_s", made / ours, HF_GENERATE, made / theirs)]


# ---- serve: the server under concurrent streaming clients -----------------------------------------
@dataclass(frozen=True)
class Answer:
    """One streamed request: seconds to its first text, tokens generated, seconds in all."""

    ttft: float
    tokens: int
    seconds: float


async def completion_events(client: Any, prompt: list[int], max_tokens: int) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed greedy ``/v1/completions`` of token ids ``prompt`` (with
    the usage chunk last); RuntimeError when the server refuses it or fails it mid-stream."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line.removeprefix("data: "))
            if data.get("error"):
                raise RuntimeError(f"the server failed a request: {data['error']}")
            yield data


async def ask(client: Any, prompt: list[int], w: Workload) -> Answer:
    """One streamed completion of token ids ``prompt``, timed from sending it."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for data in completion_events(client, prompt, w.new_tokens):
        if first is None and data["choices"] and data["choices"][0]["text"]:
            first = time.perf_counter() - start
        if data.get("usage"):
            tokens = int(data["usage"]["completion_tokens"])
    if first is None or tokens != w.new_tokens:
        raise RuntimeError(f"a request streamed {tokens} tokens, {w.new_tokens} were asked for")
    return Answer(first, tokens, time.perf_counter() - start)


async def rounds_against(url: str, w: Workload) -> dict[str, list[Any]]:
    """A warm-up, then ``rounds`` x (one request alone, ``clients`` requests at once)."""
    import httpx

    prompts = prompts_of(w, w.clients)
    limits = httpx.Limits(max_connections=w.clients)
    alone: list[Answer] = []
    together: list[list[Answer]] = []
    walls: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await ask(client, prompts[0], w)
        await asyncio.gather(*(ask(client, p, w) for p in prompts))
        for _ in range(w.rounds):
            alone.append(await ask(client, prompts[0], w))
            start = time.perf_counter()
            together.append(list(await asyncio.gather(*(ask(client, p, w) for p in prompts))))
            walls.append(time.perf_counter() - start)
    return {"alone": alone, "together": together, "walls": walls}


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def write_folder(model: torch.nn.Module, vocab: int, folder: Path) -> None:
    """``model`` as a Hugging Face folder, with a word-level tokenizer of its whole vocabulary
    (token ``i`` is the word ``t<i>``) so that every generated id has text."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(folder)  # type: ignore[operator]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)


def run_server(model: torch.nn.Module, w: Workload) -> dict[str, list[Any]]:
    """Start the server on ``model`` (saved to a temporary folder), run the clients, stop it."""
    from tessera.serve.app import Limits
    from tessera.serve.ranks import EngineOptions

    blocks = w.clients * -(-(w.prompt + w.new_tokens) // 16) + 16
    options = EngineOptions(num_blocks=blocks, block_size=16, max_batch=max(w.clients, 1))
    with served(model, w.vocab, options, Limits(max_concurrent_requests=max(64, w.clients)), w.threads) as url:
        return asyncio.run(rounds_against(url, w))


@contextmanager
def served(model: torch.nn.Module, vocab: int, options: Any, limits: Any, threads: int) -> Iterator[str]:
    """The real server on ``model`` (saved to a temporary folder with a word-level tokenizer of
    ``vocab`` words): a :class:`~tessera.serve.ranks.RankBackend` of one rank on ``threads``
    intra-op threads with engine ``options`` (``EngineOptions``), the app under ``limits``
    (``Limits``), served by uvicorn in a thread. Yields its base URL; stops it all on exit."""
    from tessera.serve.app import create_app
    from tessera.serve.http import serving
    from tessera.serve.ranks import RankBackend
    from tessera.serve.sources import resolve_source

    with tempfile.TemporaryDirectory(prefix="tessera-bench-serve-") as root:
        folder = Path(root) / "model"
        write_folder(model, vocab, folder)
        backend = RankBackend(resolve_source(str(folder)), options, log_dir=Path(root) / "logs")
        with _env("OMP_NUM_THREADS", str(threads)):  # the rank's intra-op threads
            backend.start()
        try:
            with serving(create_app(backend, served_name="bench", limits=limits)) as url:
                yield url
        finally:
            backend.close_now()


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (the smallest value with at least ``q`` of them at or below)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def serve_rows(w: Workload, result: dict[str, list[Any]]) -> list[Row]:
    alone: list[Answer] = result["alone"]
    together = [a for answers in result["together"] for a in answers]
    name = f"serve {w.tag} c{w.clients}"
    first, first_alone = [a.ttft for a in together], [a.ttft for a in alone]
    made = [sum(a.tokens for a in answers) / wall for answers, wall in zip(result["together"], result["walls"])]
    made_alone = [a.tokens / a.seconds for a in alone]
    return [
        Row(name, "ttft_median_s", statistics.median(first), ALONE, statistics.median(first_alone)),
        Row(name, "ttft_p90_s", nearest_rank(first, 0.9), ALONE, nearest_rank(first_alone, 0.9)),
        Row(name, "tokens_per_s", statistics.median(made), ALONE, statistics.median(made_alone)),
    ]


# ---- the whole benchmark ---------------------------------------------------------------------------
def run(w: Workload | None = None, *, serve: bool = True) -> list[Row]:
    """The decode rows of each batch in ``w.batches`` and, with ``serve``, the server's rows."""
    w = w or Workload()
    threads = torch.get_num_threads()
    torch.set_num_threads(w.threads)
    try:
        model = build_model(w)
        sides = {TESSERA: tessera_side(model, w), HF_GENERATE: hf_side(model, w)}
        rows: list[Row] = []
        for batch in w.batches:
            timed = time_decode(w, batch, sides)
            check_tokens(batch, timed["tokens"])
            rows += decode_rows(w, batch, timed["seconds"])
        if serve:
            rows += serve_rows(w, run_server(model, w))
    finally:
        torch.set_num_threads(threads)
    return rows


def require_extras() -> None:
    """Raises NotAvailableError naming the extra to install when one of the bench's modules is missing."""
    from tessera.errors import NotAvailableError

    for module, extra in (("transformers", "hf"), ("fastapi", "serve"), ("uvicorn", "serve"), ("httpx", "test")):
        try:
            __import__(module)
        except ImportError as error:
            raise NotAvailableError(f"tessera bench serve needs {module}: pip install 'tessera[{extra}]'") from error


def main(args: argparse.Namespace) -> int:
    require_extras()
    w = Workload()
    rows = run(w)
    print_rows(rows)
    print(
        f"decode: {w.repeats} alternating runs per side of {w.new_tokens} greedy tokens after {w.prompt}-token "
        f"prompts, medians, {w.threads} thread(s), the same tokens on both sides; serve: {w.clients} streamed clients "
        f"at once, {w.rounds} rounds, time to first token from sending the request"
    )
    if args.out:
        write_rows(rows, args.out)
    return 0
