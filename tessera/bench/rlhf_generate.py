"""``tessera bench rlhf-generate``: rollouts with the paged KV cache against re-running the whole
sequence through the model for every new token, on the same training model, on CPU.

One process, tessera's GPT (default the ``tiny`` preset: width 128, 4 blocks, byte vocabulary,
``max_seq_len`` = prompt + new tokens), in train mode as a PPO actor is between steps, the same
weights on both sides; prompts of ``prompt`` random tokens, ``new_tokens`` sampled after each
(temperature 1, a seed per request, no stop token: every request makes all its tokens):

- tessera: :meth:`~tessera.rlhf.rollout.RolloutGenerator.generate`, the inference engine's paged
  KV cache and continuous batching over the live module (no copy), on a context of the rank
  alone;
- anchor: :func:`~tessera.rlhf.rollout.generate_without_cache`, the same requests, seeds and
  sampling with the unfinished sequences through the model's ``forward`` as one right-padded
  batch for every new token (what generating without a cache costs).

Inside PPO (``ppo_rows``): a :class:`~tessera.rlhf.ppo.PPOTrainer` of the same actor (a critic
of the same size, a frozen reference, a rule reward) takes whole PPO steps (rollout, experience,
update) at batch ``ppo_batch``, its rollouts made by either side in turn; the rows give the
rollout phase's tokens per second and whole PPO steps per second.

Before timing, both sides generate greedily from the same prompts and must give the same tokens,
or the run fails (a side that computes something else has no speed to compare). Then, after a
warm-up each, they alternate ``repeats`` timed runs (ABAB, then BABA) on ``threads`` intra-op
threads; ``tokens_per_s`` is ``batch * new_tokens`` over the median run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.checks import same_tokens
from tessera.bench.report import Row, print_rows, write_rows

if TYPE_CHECKING:
    from tessera.models.gpt import GPT

TESSERA = "KV cache"
ANCHOR = "full forward per token"

Side = Callable[[list[list[int]], Any], list[list[int]]]


@dataclass(frozen=True)
class Workload:
    """GPT ``preset`` (fields replaced by ``overrides``; ``max_seq_len`` = ``prompt`` +
    ``new_tokens``), ``batches`` of prompts of ``prompt`` tokens, ``new_tokens`` sampled at
    ``temperature`` after each; ``repeats`` timed runs per side and batch on ``threads``
    intra-op threads."""

    preset: str = "tiny"
    prompt: int = 16
    new_tokens: int = 128
    batches: tuple[int, ...] = (1, 16)
    temperature: float = 1.0
    repeats: int = 5
    threads: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    ppo_batch: int = 16

    @property
    def tag(self) -> str:
        return f"gpt-{self.preset} {self.prompt}+{self.new_tokens}"


def build_model(w: Workload) -> GPT:
    """The actor both sides generate with: seeded, in train mode (generation switches to eval)."""
    from tessera.models.gpt import GPT, preset_config

    torch.manual_seed(0)
    return GPT(preset_config(w.preset, max_seq_len=w.prompt + w.new_tokens, **w.overrides)).train()


def prompts_of(w: Workload, model: GPT, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, model.config.vocab_size, (count, w.prompt), generator=g).tolist()


def sides_of(model: GPT) -> dict[str, Side]:
    """Each side as ``generate(prompts, params) -> responses`` (seed 0 for every call)."""
    from tessera.inference.params import SamplingParams
    from tessera.rlhf.rollout import RolloutGenerator, generate_without_cache

    generator = RolloutGenerator(model, SamplingParams())

    def cached(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return [r.response for r in generator.generate(prompts, seed=0, params=params)]

    def uncached(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return [r.response for r in generate_without_cache(model, prompts, params, seed=0)]

    return {TESSERA: cached, ANCHOR: uncached}


def check_tokens(batch: int, tokens: dict[str, list[list[int]]]) -> None:
    """Raises unless both sides' greedy tokens are the same, naming the first difference."""
    same_tokens(batch, tokens, TESSERA, ANCHOR)


def measure(w: Workload, model: GPT, batch: int, sides: dict[str, Side]) -> dict[str, Any]:
    """The greedy tokens of each side (checked equal), then the seconds of each timed sampled run."""
    from tessera.inference.params import SamplingParams

    prompts = prompts_of(w, model, batch)
    greedy = SamplingParams(max_tokens=w.new_tokens, temperature=0.0)
    tokens = {name: side(prompts, greedy) for name, side in sides.items()}
    check_tokens(batch, tokens)
    sampled = SamplingParams(max_tokens=w.new_tokens, temperature=w.temperature)
    for side in sides.values():  # warm-up
        side(prompts, sampled)
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(w.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            made = sides[name](prompts, sampled)
            seconds[name].append(time.perf_counter() - start)
            if sum(map(len, made)) != batch * w.new_tokens:
                raise RuntimeError(f"{name} made {sum(map(len, made))} tokens, {batch * w.new_tokens} were asked for")
    return {"greedy": tokens, "seconds": seconds}


def rows_of(w: Workload, batch: int, seconds: dict[str, list[float]]) -> list[Row]:
    made = batch * w.new_tokens
    ours, theirs = statistics.median(seconds[TESSERA]), statistics.median(seconds[ANCHOR])
    return [Row(f"rlhf-generate {w.tag} b{batch}", "tokens_per_s", made / ours, ANCHOR, made / theirs)]


def run(w: Workload | None = None, report: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """The row of each batch in ``w.batches``; ``report``, when given, receives per row name
    both sides' greedy tokens and the seconds of their timed runs."""
    w = w or Workload()
    threads = torch.get_num_threads()
    torch.set_num_threads(w.threads)
    try:
        model = build_model(w)
        sides = sides_of(model)
        rows: list[Row] = []
        for batch in w.batches:
            result = measure(w, model, batch, sides)
            batch_rows = rows_of(w, batch, result["seconds"])
            rows += batch_rows
            if report is not None:
                report[batch_rows[0].name] = result
    finally:
        torch.set_num_threads(threads)
    return rows


class _Uncached:
    """The anchor in a PPO trainer's place of its generator: the same ``generate`` call answered by
    :func:`~tessera.rlhf.rollout.generate_without_cache`."""

    def __init__(self, model: torch.nn.Module, params: Any) -> None:
        self.model, self.params = model, params

    def generate(self, prompts: Any, *, seed: int | None = None, params: Any = None, offset: int = 0) -> Any:
        from tessera.rlhf.rollout import generate_without_cache

        return generate_without_cache(self.model, prompts, params or self.params, seed=seed, offset=offset)


def ppo_rows(w: Workload, report: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """Whole PPO steps with the KV-cache generator against the full forward per token in its
    place: the rollout phase's tokens/s and PPO steps/s, each side's median over ``repeats``."""
    import tessera
    from tessera.inference.params import SamplingParams
    from tessera.rlhf import Frozen, PPOOptions, PPOTrainer, value_model
    from tessera.testing import use_layout

    threads = torch.get_num_threads()
    torch.set_num_threads(w.threads)
    try:
        use_layout(config={})
        actor = build_model(w)
        engines = []
        for model in (actor, value_model(build_model(w))):
            engine, _, _, _ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
            engines.append(engine)
        params = SamplingParams(max_tokens=w.new_tokens, temperature=w.temperature)
        trainer = PPOTrainer(
            engines[0], engines[1], Frozen(build_model(w)), _even_tokens, params, PPOOptions(kl_coef=0.05)
        )
        sides: dict[str, Any] = {TESSERA: trainer.generator, ANCHOR: _Uncached(engines[0].module, params)}
        prompts = prompts_of(w, actor, w.ppo_batch)
        rollout_s: dict[str, list[float]] = {name: [] for name in sides}
        step_s: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for repeat in range(w.repeats + 1):  # the first round warms up
            for name in names if repeat % 2 == 0 else names[::-1]:
                trainer.generator = sides[name]
                start = time.perf_counter()
                responses = trainer.rollout(prompts, seed=repeat)
                generated = time.perf_counter()
                trainer.train(trainer.experience(prompts, responses))
                if repeat:
                    rollout_s[name].append(generated - start)
                    step_s[name].append(time.perf_counter() - start)
                if sum(map(len, responses)) != w.ppo_batch * w.new_tokens:
                    raise RuntimeError(f"{name} made {sum(map(len, responses))} tokens in a PPO rollout")
    finally:
        torch.set_num_threads(threads)
    made = w.ppo_batch * w.new_tokens
    tag = f"rlhf-generate {w.tag} ppo b{w.ppo_batch}"
    rows = [
        Row(
            f"{tag} rollout",
            "tokens_per_s",
            made / statistics.median(rollout_s[TESSERA]),
            ANCHOR,
            made / statistics.median(rollout_s[ANCHOR]),
        ),
        Row(
            f"{tag} step",
            "steps_per_s",
            1 / statistics.median(step_s[TESSERA]),
            ANCHOR,
            1 / statistics.median(step_s[ANCHOR]),
        ),
    ]
    if report is not None:
        report[tag] = {"rollout_seconds": rollout_s, "step_seconds": step_s}
    return rows


def _even_tokens(prompt: Any, response: Any) -> float:
    """A rule reward for the bench: the share of even token ids in the response."""
    return sum(1 for t in response if t % 2 == 0) / max(len(response), 1)


def main(args: argparse.Namespace) -> int:
    w = Workload()
    rows = run(w) + ppo_rows(w)
    print_rows(rows)
    print(
        f"{w.repeats} alternating runs per side of {w.new_tokens} tokens sampled at temperature {w.temperature} after "
        f"{w.prompt}-token prompts, medians, {w.threads} thread(s); the same greedy tokens on both sides"
    )
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["ANCHOR", "TESSERA", "Workload", "check_tokens", "main", "measure", "ppo_rows", "rows_of", "run"]
