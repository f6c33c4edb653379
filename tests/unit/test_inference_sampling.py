"""tessera.inference.sampling: greedy rows, top-k, top-p, temperature, and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.inference.params import SamplingParams
from tessera.inference.sampling import request_generator, sample, sampling_distribution


def draws(logits: torch.Tensor, params: SamplingParams, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` tokens drawn from one row of ``logits [V]`` (one batch, one shared generator)."""
    generator = torch.Generator().manual_seed(seed)
    batch = logits.expand(count, -1)
    return sample(batch, [params] * count, [generator] * count)


def test_greedy_rows_take_the_argmax_lowest_id_on_ties():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1  # a tie: the lower id wins, as torch.argmax
    greedy = SamplingParams(temperature=0.0)
    tokens = sample(logits, [greedy] * 5, [None] * 5)
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    assert torch.equal(tokens, logits.float().argmax(dim=-1)) and int(tokens[2]) == 7


def test_greedy_and_sampled_rows_share_a_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)
    generator = torch.Generator().manual_seed(0)
    tokens = sample(logits, [greedy, hot, greedy, hot], [None, generator, None, generator])
    assert torch.equal(tokens, logits.argmax(dim=-1))  # top_k=1 leaves only the argmax to draw


def test_top_k_draws_only_and_all_of_the_k_largest():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    drawn = draws(logits, SamplingParams(temperature=1.0, top_k=5), 3000)
    assert set(drawn.tolist()) == top5


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # by probability: ids 1, 3, 2, 0
    logits = probs.log()
    expected = {0.4: [1], 0.75: [1, 3], 0.9: [1, 3, 2], 0.99: [1, 3, 2, 0]}
    for top_p, kept in expected.items():
        ids, kept_probs = sampling_distribution(logits, SamplingParams(top_p=top_p))
        assert ids is not None and ids.tolist() == kept, top_p
        torch.testing.assert_close(kept_probs, probs[kept] / probs[kept].sum())
    # top-k first (ids 1 and 3, renormalised to 0.625 and 0.375), then top-p on that distribution
    ids, kept_probs = sampling_distribution(logits, SamplingParams(top_k=2, top_p=0.6))
    assert ids is not None and ids.tolist() == [1]
    ids, kept_probs = sampling_distribution(logits, SamplingParams(top_k=2, top_p=0.7))
    assert ids is not None and ids.tolist() == [1, 3]
    torch.testing.assert_close(kept_probs, torch.tensor([0.625, 0.375]))
    assert set(draws(logits, SamplingParams(top_p=0.75), 500).tolist()) == {1, 3}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value for 7 degrees of freedom (8 categories) at p = 0.001 (scipy's
# chi2.ppf(0.999, 7)): a correct sampler exceeds it one run in a thousand; the draws are seeded,
# so this test gives the same answer every run.
CHI2_7_DOF_P001 = 24.32


def test_temperature_frequencies_match_softmax_of_scaled_logits():
    logits = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0])
    temperature, count = 0.7, 20_000
    drawn = draws(logits, SamplingParams(temperature=temperature), count, seed=3)
    counts = torch.bincount(drawn, minlength=8).float()
    target = torch.softmax(logits / temperature, dim=-1)
    assert chi_square(counts, target) < CHI2_7_DOF_P001
    # max-abs check: the frequency of a p ~ 0.4 token has a standard deviation of 0.0035 at 20000 draws
    assert float((counts / count - target).abs().max()) < 0.012
    # the test can fail: the same draws are far from the unscaled softmax (temperature ignored)
    assert chi_square(counts, torch.softmax(logits, dim=-1)) > 10 * CHI2_7_DOF_P001


def tokens_of(request: SamplingParams, index: int, steps: torch.Tensor, batch_with: int) -> list[int]:
    """The tokens ``request`` draws at each step of ``steps [T, V]`` (its own logits), sharing
    each step's batch with ``batch_with`` other requests at a changing position."""
    mine = request_generator(request, index)
    greedy, other = SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, seed=99)
    others = [(greedy, None), (other, request_generator(other, index + 1))] * batch_with
    noise = torch.Generator().manual_seed(index)
    out = []
    for step, logits in enumerate(steps):
        rows = [(request, mine, logits)] + [(p, g, torch.randn(logits.shape, generator=noise)) for p, g in others]
        position = step % len(rows)
        rows.insert(position, rows.pop(0))
        tokens = sample(torch.stack([r[2] for r in rows]), [r[0] for r in rows], [r[1] for r in rows])
        out.append(int(tokens[position]))
    return out


def test_a_seeded_request_draws_the_same_alone_or_in_any_batch():
    steps = torch.randn(30, 64, generator=torch.Generator().manual_seed(4))
    request = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    alone = tokens_of(request, 0, steps, batch_with=0)
    assert alone == tokens_of(request, 7, steps, batch_with=1) == tokens_of(request, 12, steps, batch_with=3)


def test_different_seeds_and_unseeded_requests_differ():
    steps = torch.zeros(30, 64)  # uniform: two streams agreeing on 30 draws has chance 64^-30
    first = tokens_of(SamplingParams(seed=1), 0, steps, batch_with=0)
    assert first != tokens_of(SamplingParams(seed=2), 0, steps, batch_with=0)
    unseeded = SamplingParams()
    assert tokens_of(unseeded, 0, steps, batch_with=0) != tokens_of(unseeded, 1, steps, batch_with=0)


def test_generators_greedy_none_and_seed_folded_into_range():
    assert request_generator(SamplingParams(temperature=0.0, seed=3), 0) is None
    for seed in (-1, 2**70):  # any Python int is a valid seed: folded into torch's 64-bit range
        generator = request_generator(SamplingParams(seed=seed), 0)
        assert generator is not None and generator.initial_seed() == seed % 2**64


def test_bad_calls_raise():
    logits = torch.zeros(2, 8)
    hot = SamplingParams()
    with pytest.raises(ValueError, match="row 1 samples"):
        sample(logits, [SamplingParams(temperature=0.0), hot], [None, None])
    with pytest.raises(ValueError, match="2 rows of logits, 1 params"):
        sample(logits, [hot], [None])
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample(torch.zeros(8), [hot], [None])
    with pytest.raises(ValueError, match="greedy"):
        sampling_distribution(logits[0], SamplingParams(temperature=0.0))
    assert math.isclose(float(sampling_distribution(logits[0], hot)[1].sum()), 1.0, rel_tol=1e-6)
