"""``tessera bench serve --workload``: the server under a realistic load, against Hugging Face
``generate`` in static batches and transformers' own continuous batching, on CPU.

The workload (seeded, the same on every side): ``requests`` requests arrive as a Poisson process
at each rate of ``rates`` (requests per second; one draw of exponential gaps, scaled by the
rate). Each request's own prompt length and its output length are log-normal (a median and a
sigma each, rounded, truncated to ``[1, prompt_max]`` and ``[2, output_max]``), its prompt
random token ids; a ``prefix_fraction`` of the requests start with the same ``prefix_tokens``-
token system prompt. Every request asks for exactly its output length (greedy, no
end-of-sequence token: the model has none), and every side must give each request exactly that
many tokens, and the same tokens: a side that computes something else fails the run.

One random ``LlamaForCausalLM`` (float32, ``threads`` intra-op threads, no download) serves on
every side (``tessera.bench.serve_load_sides``); one client, the same for all, sends each request
at its arrival time and reads its tokens as they stream. Per side and rate:

- ``tokens_per_s``: all output tokens over the makespan (first arrival to last completion);
- ``ttft_p50_s``, ``ttft_p99_s``: time to first token, from the request's arrival (nearest rank);
- ``tpot_p50_s``, ``tpot_p99_s``: time per output token after the first, per request
  ``(last - first token) / (output tokens - 1)``.

Rows: tessera's server as the value, each transformers side as an anchor. Printed beside them:
the workload as drawn, and per side and rate the makespan and the longest wait between two
tokens of one stream. All sides are started first; at each rate they run in turn (:func:`measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.bench.checks import same_tokens
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.serve import build_llama, nearest_rank, require_extras
from tessera.bench.serve_load_sides import HF_CB, HF_STATIC, SIDES, TESSERA, Side

METRICS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
REQUIRED = (TESSERA, HF_STATIC)  # the measured side and its anchor; HF CB is left out (with why) if it cannot run


@dataclass(frozen=True)
class LoadWorkload:
    """The model (a ``LlamaForCausalLM`` of ``layers`` layers of width ``hidden``, ``heads`` query
    heads over ``kv_heads`` key/value heads, vocabulary ``vocab``, ``context`` positions), the
    requests and their arrival rates, and the batch every side may run at once."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    context: int = 1024
    requests: int = 64
    """Requests per rate."""
    rates: tuple[float, ...] = (2.0, 8.0, 24.0)
    """Arrival rates, requests per second: one every side keeps up with, about what static batches
    sustain on one thread (~300 tokens/s, 8 requests/s), and well past it."""
    prompt_median: float = 48.0
    prompt_sigma: float = 1.0
    prompt_max: int = 512
    """A request's own prompt (after the shared prefix, if it has it): log-normal, at most this."""
    output_median: float = 32.0
    output_sigma: float = 0.8
    output_max: int = 256
    """Output tokens asked for (``max_tokens``): log-normal, at least 2, at most this."""
    prefix_tokens: int = 192
    prefix_fraction: float = 0.5
    """The fraction of the requests that start with the same ``prefix_tokens``-token system prompt."""
    max_batch: int = 16
    """The most requests computed at once on every side (static batch size; running sequences)."""
    block_size: int = 16
    max_prefill_tokens: int = 4096
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        from tessera.errors import ConfigError

        longest = self.prefix_tokens + self.prompt_max + self.output_max
        if longest > self.context:
            raise ConfigError(
                f"prefix_tokens + prompt_max + output_max = {longest} is more than the model's context ({self.context})"
            )
        if not self.rates or any(not rate > 0 for rate in self.rates) or len(set(self.rates)) < len(self.rates):
            raise ConfigError(f"rates={self.rates} must be one or more distinct positive requests per second")
        if min(self.requests, self.max_batch, self.prompt_max, self.threads) < 1 or self.output_max < 2:
            raise ConfigError("requests, max_batch, prompt_max and threads must be at least 1, output_max at least 2")
        if not 0.0 <= self.prefix_fraction <= 1.0:
            raise ConfigError(f"prefix_fraction={self.prefix_fraction} must be between 0 and 1")
        if min(self.prompt_median, self.output_median) <= 0 or min(self.prompt_sigma, self.output_sigma) < 0:
            raise ConfigError("the length medians must be positive and their sigmas at least 0")

    @property
    def kv_blocks(self) -> int:
        """KV blocks for ``max_batch`` sequences of the longest request (nobody waits for memory)."""
        longest = self.prefix_tokens + self.prompt_max + self.output_max
        return self.max_batch * -(-longest // self.block_size) + 1

    @property
    def tag(self) -> str:
        return f"llama h{self.hidden} l{self.layers}"


# ---- the requests ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One request: its prompt (the shared prefix first, when ``shared``), the output tokens it
    asks for, and the gap before it in units of the mean gap (exponential; 0 for the first)."""

    prompt: list[int]
    max_tokens: int
    shared: bool
    gap: float


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def requests_of(w: LoadWorkload, draw: int = 0) -> list[Request]:
    """The workload's requests (seeded by ``w.seed``, Python's ``random``). Every ``draw`` has the
    same lengths, gaps and system prompt; ``draw`` picks the token ids of the requests' own
    prompts, so that no draw finds its prompts in a cache an earlier draw filled (each rate, and
    the warm-up, has its own: a prefix cache keeps only the system prompt from one to the next)."""
    rng = random.Random(w.seed)
    ids = random.Random(f"{w.seed}/{draw}")
    prefix = [rng.randrange(1, w.vocab) for _ in range(w.prefix_tokens)]
    shared = set(rng.sample(range(w.requests), round(w.prefix_fraction * w.requests)))
    requests = []
    for i in range(w.requests):
        own = _lognormal(rng, w.prompt_median, w.prompt_sigma, 1, w.prompt_max)
        max_tokens = _lognormal(rng, w.output_median, w.output_sigma, 2, w.output_max)
        gap = rng.expovariate(1.0) if i else 0.0
        prompt = [ids.randrange(1, w.vocab) for _ in range(own)]
        requests.append(Request(prefix + prompt if i in shared else prompt, max_tokens, i in shared, gap))
    return requests


def arrivals(requests: list[Request], rate: float) -> list[float]:
    """Seconds from the first arrival to each request's, at ``rate`` requests per second."""
    return list(itertools.accumulate(r.gap / rate for r in requests))


# ---- the client: the same on every side -------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """One request on one side: seconds from the first arrival to its arrival, and from its
    arrival to its first token and to its last; the tokens it got; the longest wait between two
    of its tokens (a stream held up, by another request's prefill for one)."""

    arrival: float
    first: float
    last: float
    tokens: list[int] = field(repr=False)
    stall: float = 0.0


async def drive(side: Side, requests: list[Request], rate: float) -> list[Served]:
    """Send each request at its arrival time (``rate`` requests per second) and read its stream."""
    times = arrivals(requests, rate)
    start = time.perf_counter()

    async def one(request: Request, at: float) -> Served:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tokens: list[int] = []
        first = previous = None
        stall = 0.0
        async for ids in side.stream(request.prompt, request.max_tokens):
            now = time.perf_counter() - start - at
            if previous is None:
                first = now
            else:
                stall = max(stall, now - previous)
            previous = now
            tokens += ids
        if first is None or len(tokens) != request.max_tokens:
            raise RuntimeError(f"a request got {len(tokens)} tokens, {request.max_tokens} were asked for")
        return Served(at, first, time.perf_counter() - start - at, tokens, stall)

    return list(await asyncio.gather(*(one(r, at) for r, at in zip(requests, times, strict=True))))


async def measure(
    model: torch.nn.Module, w: LoadWorkload, requests: dict[float, list[Request]], sides: tuple[str, ...]
) -> tuple[dict[str, dict[float, list[Served]]], dict[str, str]]:
    """Each side's answers to ``requests[rate]`` at each rate, and why the sides that could not
    run did not.

    Every side is started at once and warmed up (two short requests at once); an idle side
    waits without computing. Then at each rate every side runs in turn, the order reversed from
    one rate to the next, so that a machine whose load drifts weighs on every side alike. A
    required side that fails raises; another is left out with its error."""
    missing: dict[str, str] = {}
    warm_up = [dataclasses.replace(r, max_tokens=2) for r in requests_of(w, draw=len(w.rates))[:2]]
    async with contextlib.AsyncExitStack() as stack:
        opened: dict[str, Side] = {}
        for name in sides:
            try:
                opened[name] = await stack.enter_async_context(SIDES[name](copy.deepcopy(model), w))
                await drive(opened[name], warm_up, math.inf)
            except Exception as error:
                if name in REQUIRED:
                    raise
                opened.pop(name, None)
                missing[name] = f"{type(error).__name__}: {error}"
        served: dict[str, dict[float, list[Served]]] = {name: {} for name in opened}
        for i, rate in enumerate(w.rates):
            for name in list(opened) if i % 2 == 0 else list(opened)[::-1]:
                if name in missing:
                    continue
                try:
                    served[name][rate] = await drive(opened[name], requests[rate], rate)
                except Exception as error:
                    if name in REQUIRED:
                        raise
                    del served[name]
                    missing[name] = f"{type(error).__name__}: {error}"
    return served, missing


def check_same_tokens(rate: float, served: dict[str, list[Served]]) -> None:
    """Raises unless every side gave every request the tokens of HF static batches."""
    tokens = {name: [s.tokens for s in answers] for name, answers in served.items()}
    for name in tokens:
        if name != HF_STATIC:
            try:
                same_tokens(len(tokens[name]), tokens, name, HF_STATIC)
            except RuntimeError as error:
                raise RuntimeError(f"at {rate:g} requests/s: {error}") from None


# ---- the whole benchmark ---------------------------------------------------------------------------
@dataclass
class Outcome:
    requests: dict[float, list[Request]]  # rate -> its draw (the same lengths at every rate)
    served: dict[str, dict[float, list[Served]]]  # side -> rate -> each request, in order
    missing: dict[str, str]  # side -> why it did not run
    params: int


def run(w: LoadWorkload | None = None, sides: tuple[str, ...] = tuple(SIDES)) -> Outcome:
    """Every side of ``sides`` under the workload at every rate (:func:`measure`), the tokens checked."""
    w = w or LoadWorkload()
    threads = torch.get_num_threads()
    torch.set_num_threads(w.threads)
    try:
        model = build_llama(w, positions=w.context)
        requests = {rate: requests_of(w, draw) for draw, rate in enumerate(w.rates)}
        served, missing = asyncio.run(measure(model, w, requests, sides))
        for rate in w.rates:
            check_same_tokens(rate, {name: by_rate[rate] for name, by_rate in served.items()})
    finally:
        torch.set_num_threads(threads)
    return Outcome(requests, served, missing, sum(p.numel() for p in model.parameters()))


def summary(answers: list[Served]) -> dict[str, float]:
    """The metrics of one side at one rate."""
    made = sum(len(a.tokens) for a in answers)
    makespan = max(a.arrival + a.last for a in answers)
    ttft = [a.first for a in answers]
    tpot = [(a.last - a.first) / (len(a.tokens) - 1) for a in answers]
    return {
        "tokens_per_s": made / makespan,
        "ttft_p50_s": nearest_rank(ttft, 0.5),
        "ttft_p99_s": nearest_rank(ttft, 0.99),
        "tpot_p50_s": nearest_rank(tpot, 0.5),
        "tpot_p99_s": nearest_rank(tpot, 0.99),
    }


def rows_of(w: LoadWorkload, outcome: Outcome) -> list[Row]:
    """Per rate and metric: tessera's server against each transformers side that ran."""
    rows = []
    for rate in w.rates:
        ours = summary(outcome.served[TESSERA][rate])
        for anchor in (HF_STATIC, HF_CB):
            if anchor in outcome.served:
                theirs = summary(outcome.served[anchor][rate])
                rows += [Row(f"load {w.tag} {rate:g}/s", m, ours[m], anchor, theirs[m]) for m in METRICS]
    return rows


def _spread(values: list[int]) -> str:
    return f"median {statistics.median(values):g}, mean {statistics.fmean(values):.1f}, max {max(values)}"


def describe(w: LoadWorkload, outcome: Outcome) -> str:
    """The workload, as printed beside the rows."""
    requests = next(iter(outcome.requests.values()))
    shared = sum(r.shared for r in requests)
    own = [len(r.prompt) - (w.prefix_tokens if r.shared else 0) for r in requests]
    lines = [
        f"model: random LlamaForCausalLM, hidden {w.hidden}, {w.layers} layers, {w.heads} query / {w.kv_heads} "
        f"key-value heads, MLP {w.intermediate}, vocabulary {w.vocab}, context {w.context}, fp32, "
        f"{outcome.params:,} parameters, {w.threads} intra-op thread(s) per side",
        f"requests: {w.requests} per rate, Poisson arrivals at {', '.join(f'{r:g}' for r in w.rates)} requests/s "
        f"(seed {w.seed})",
        f"prompt (own part): log-normal median {w.prompt_median:g}, sigma {w.prompt_sigma:g}, in [1, "
        f"{w.prompt_max}]: {_spread(own)}",
        f"shared prefix: {shared} of {w.requests} requests ({w.prefix_fraction:g}) start with the same "
        f"{w.prefix_tokens}-token system prompt",
        f"output: log-normal median {w.output_median:g}, sigma {w.output_sigma:g}, in [2, {w.output_max}]: "
        f"{_spread([r.max_tokens for r in requests])}; greedy, exactly max_tokens each",
        f"batch: at most {w.max_batch} requests at once on every side; KV blocks {w.kv_blocks} x {w.block_size} "
        f"tokens; tessera over HTTP (streamed /v1/completions, one rank), HF in process",
    ]
    for name, by_rate in outcome.served.items():
        for rate, answers in by_rate.items():
            stalls = [a.stall for a in answers]
            lines.append(
                f"{name} at {rate:g}/s: makespan {max(a.arrival + a.last for a in answers):.2f} s; the longest wait "
                f"between two tokens of a stream: median {statistics.median(stalls) * 1e3:.0f} ms, "
                f"max {max(stalls) * 1e3:.0f} ms"
            )
    lines += [f"{name}: not run: {why}" for name, why in outcome.missing.items()]
    return "\n".join(lines)


_KINDS = {int: "an integer", float: "a number"}


def workload_of(args: argparse.Namespace) -> LoadWorkload:
    """The workload of ``tessera bench serve --workload [--rates R,R] [--requests N] [--set KEY=VALUE]``."""
    from tessera.errors import ConfigError

    known = {f.name: f for f in dataclasses.fields(LoadWorkload)}
    values: dict[str, Any] = {}
    for item in getattr(args, "set", None) or []:
        key, eq, text = item.partition("=")
        if not eq or key not in known or key == "rates":
            names = ", ".join(n for n in known if n != "rates")
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with KEY one of {names} (rates: --rates)")
        kind = type(getattr(LoadWorkload(), key))
        try:
            values[key] = kind(text)
        except ValueError as error:
            raise ConfigError(f"--set {item!r}: {key} takes {_KINDS[kind]}") from error
    if getattr(args, "rates", None):
        try:
            values["rates"] = tuple(float(r) for r in args.rates.split(","))
        except ValueError as error:
            raise ConfigError(f"--rates {args.rates!r}: expected requests per second, comma-separated") from error
    if getattr(args, "requests", None) is not None:
        values["requests"] = args.requests
    return LoadWorkload(**values)


def main(args: argparse.Namespace) -> int:
    require_extras()
    w = workload_of(args)
    outcome = run(w)
    rows = rows_of(w, outcome)
    print_rows(rows)
    print(describe(w, outcome))
    if args.out:
        write_rows(rows, args.out)
    return 0
