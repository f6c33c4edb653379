"""How far each token (or expert) a reference computation chose was from being another: the margin
that lets a test compare choices made two ways (a KV cache and a full forward, another layout)
exactly.

A token is a discrete choice: a rounding that moves the logits can flip it where two candidates
are close. :func:`recorded_draws` records, for every token that :func:`tessera.inference.sampling.sample`
chooses while it is active, the smallest change of the logits that could choose another:

* a greedy row: the gap between the two largest logits;
* a sampled row: ``torch.multinomial`` draws ``argmax(p / q)`` with ``q ~ Exp(1)`` from the
  request's generator (checked on every draw against a replay of that generator), so the gap
  between the two largest ``log(p / q)``; with top-k or top-p, where the draw pairs each ``q``
  with a position in the sorted kept tokens, half that gap (neighbours that swap move a rival),
  the drawn token's gaps to its neighbours in that order (the first token left out included)
  and the distance of the top-p cut from ``top_p``.

:func:`greedy_draws` gives the same for argmaxes a test takes itself, :func:`route_draws` for
the top-k routing of mixture-of-experts tokens by their router logits, and
:func:`recorded_routes` records that of every :class:`tessera.nn.moe.MoE` layer.

Each gap is in logits (the scaled ones times the temperature). A rounding that moves every logit
by at most ``d`` moves each gap by at most ``2 d``; :func:`assert_draws_clear` checks every gap is
past that for ``d`` the :func:`~tessera.testing.tolerance.tolerance` of the logits, so the other
computation chooses the same tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tessera.inference import sampling
from tessera.inference.params import SamplingParams
from tessera.testing.tolerance import tolerance

__all__ = ["Draw", "assert_draws_clear", "greedy_draws", "recorded_draws", "recorded_routes", "route_draws"]


@dataclass(frozen=True)
class Draw:
    """One chosen token: ``gap``, the smallest change of the logits (module docstring) that could
    choose another, and ``size``, the largest ``|logit|`` of its row."""

    token: int
    gap: float
    size: float


def _sampled_gap(logits: torch.Tensor, params: SamplingParams, replay: torch.Generator, token: int) -> float:
    ids, probs = sampling.sampling_distribution(logits, params)
    race = probs / torch.empty_like(probs).exponential_(1, generator=replay)
    drawn, gap = int(race.argmax()), float("inf")
    if race.numel() > 1:
        top = race.topk(2)
        gap = float((top.values[0] / top.values[1]).log())
    if (drawn if ids is None else int(ids[drawn])) != token:
        raise AssertionError("torch.multinomial no longer draws argmax(p / q): update tessera.testing.draws")
    if ids is None:  # the race pairs each token with its own q: only the race's gap matters
        return gap * params.temperature
    # top-k or top-p: the race pairs each q with a position in the sorted kept tokens. Neighbours
    # closer than the rounding may swap positions, moving a rival's race value by up to twice the
    # rounding (so half the race's gap counts), and the token at the winning position changes when
    # the winner swaps with a neighbour, the first token left out included
    scaled = logits.float() / params.temperature
    ordered = torch.sort(scaled, descending=True, stable=True).values
    gaps = [gap / 2]
    if drawn > 0:
        gaps.append(float(ordered[drawn - 1] - ordered[drawn]))
    if drawn + 1 < ordered.numel():
        gaps.append(float(ordered[drawn] - ordered[drawn + 1]))
    if params.top_p < 1.0:  # the cut: where the mass before a token reaches top_p
        head = scaled.topk(params.top_k).values if 0 < params.top_k < scaled.numel() else ordered
        mass = torch.softmax(head, -1)
        gaps.append(float(((torch.cumsum(mass, -1) - mass) - params.top_p).abs().min()))
    return min(gaps) * params.temperature


@contextmanager
def recorded_draws() -> Iterator[list[Draw]]:
    """Record every token chosen by :func:`tessera.inference.sampling.sample` in this process while
    active (as :class:`Draw`, in order), wherever the module that calls it imported it."""
    real = sampling.sample
    draws: list[Draw] = []

    def recording(
        logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        replays = []
        for generator in generators:
            replay = None
            if generator is not None:
                replay = torch.Generator()
                replay.set_state(generator.get_state())
            replays.append(replay)
        tokens = real(logits, params, generators)
        for row, (p, replay, token) in enumerate(zip(params, replays, tokens.tolist(), strict=True)):
            values = logits[row].detach().float().cpu()
            if p.greedy:
                top = values.topk(2).values if values.numel() > 1 else torch.tensor([0.0, -float("inf")])
                gap = float(top[0] - top[1])
            else:
                assert replay is not None
                gap = _sampled_gap(values, p, replay, token)
            finite = values[values.isfinite()]
            draws.append(Draw(token, gap, float(finite.abs().max()) if finite.numel() else 0.0))
        return tokens

    patched = [m for m in list(sys.modules.values()) if getattr(m, "sample", None) is real]
    for module in patched:
        module.sample = recording  # type: ignore[attr-defined]
    try:
        yield draws
    finally:
        for module in patched:
            module.sample = real  # type: ignore[attr-defined]


def assert_draws_clear(draws: Sequence[Draw], dtype: torch.dtype = torch.float32, **depth: int) -> None:
    """Every draw in ``draws`` (at least one) keeps its token when each logit moves by its
    :func:`~tessera.testing.tolerance.tolerance` (``dtype``, ``depth``: its terms)."""
    tol = tolerance(dtype, **depth)
    if not draws:
        raise AssertionError("assert_draws_clear: no draws were recorded")
    close = [d for d in draws if not d.gap > 2 * (tol["atol"] + tol["rtol"] * d.size)]
    if close:
        raise AssertionError(
            f"{len(close)} of {len(draws)} chosen tokens are too close to call (gap in logits, largest |logit|): "
            + ", ".join(f"token {d.token}: {d.gap:.3g}, {d.size:.3g}" for d in close[:10])
        )


def greedy_draws(logits: torch.Tensor) -> list[Draw]:
    """The greedy choice of each row of ``logits [..., vocab]`` as :class:`Draw` (its argmax, the
    gap to the runner-up, its largest ``|logit|``): for references that take the argmax themselves."""
    return route_draws(logits, 1)


def route_draws(logits: torch.Tensor, top_k: int, ordered: bool = True) -> list[Draw]:
    """The routing of each token of router ``logits [..., experts]`` to its ``top_k`` experts as
    :class:`Draw`: its first expert, the smallest gap between the ``top_k``-th logit and the next
    (``ordered``: between any two neighbours in descending order down to that next one, for
    routing that serves first choices first), and its largest ``|logit|``."""
    flat = logits.detach().float().reshape(-1, logits.shape[-1])
    values, experts = flat.sort(dim=-1, descending=True)
    if top_k >= flat.shape[-1]:
        gaps = torch.full(flat.shape[:1], float("inf"))
        if ordered and flat.shape[-1] > 1:
            gaps = (values[:, :-1] - values[:, 1:]).amin(dim=-1)
    elif ordered:
        gaps = (values[:, :top_k] - values[:, 1 : top_k + 1]).amin(dim=-1)
    else:
        gaps = values[:, top_k - 1] - values[:, top_k]
    sizes = flat.abs().amax(dim=-1)
    return [Draw(e, g, s) for e, g, s in zip(experts[:, 0].tolist(), gaps.tolist(), sizes.tolist(), strict=True)]


@contextmanager
def recorded_routes() -> Iterator[list[Draw]]:
    """Record the routing of every token through a :class:`tessera.nn.moe.MoE` layer of this
    process while active (:func:`route_draws` of its router logits, in order: the order of the
    chosen experts decides which queue serves each first under a capacity)."""
    from tessera.nn.moe import MoE

    real = MoE.route
    routes: list[Draw] = []

    def recording(self: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, probs, weights, experts = real(self, x)
        routes.extend(route_draws(logits, self.top_k))
        return logits, probs, weights, experts

    MoE.route = recording  # type: ignore[method-assign]
    try:
        yield routes
    finally:
        MoE.route = real  # type: ignore[method-assign]
