"""``tessera bench serve`` runs end to end at a tiny size and writes well-formed rows: both
decode sides give the same greedy tokens (the run checks it), and the real server answers
concurrent streamed clients (speed is measured by the benchmark, never asserted here)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tessera.bench import serve, serve_load
from tessera.bench import serve_load_sides as sides
from tests.e2e.test_bench import check

TINY = serve.Workload(
    vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, prompt=6, new_tokens=6,
    batches=(1, 3), repeats=2, clients=3, rounds=1,
)  # fmt: skip


def test_bench_serve_rows(tmp_path):
    data = check(serve.run(TINY), tmp_path, {"tokens_per_s", "ttft_median_s", "ttft_p90_s"})
    tag = "llama h32 l2 6+6"
    assert [(row["name"], row["metric"], row["anchor"]) for row in data] == [
        (f"decode {tag} b1", "tokens_per_s", serve.HF_GENERATE),
        (f"decode {tag} b3", "tokens_per_s", serve.HF_GENERATE),
        (f"serve {tag} c3", "ttft_median_s", serve.ALONE),
        (f"serve {tag} c3", "ttft_p90_s", serve.ALONE),
        (f"serve {tag} c3", "tokens_per_s", serve.ALONE),
    ]
    ttft = {row["metric"]: row for row in data if row["metric"].startswith("ttft")}
    assert ttft["ttft_median_s"]["value"] <= ttft["ttft_p90_s"]["value"] < 60


def test_bench_serve_refuses_sides_that_generate_something_else():
    same = [[1, 2, 3], [4, 5, 6]]
    serve.check_tokens(2, {serve.TESSERA: same, serve.HF_GENERATE: [list(t) for t in same]})
    with pytest.raises(RuntimeError, match="prompt 1: .* from token 2"):
        serve.check_tokens(2, {serve.TESSERA: same, serve.HF_GENERATE: [[1, 2, 3], [4, 5, 7]]})


def test_nearest_rank_quantile():
    values = [0.5, 0.1, 0.4, 0.2, 0.3, 0.9, 0.6, 0.8, 0.7, 1.0]
    assert serve.nearest_rank(values, 0.9) == 0.9
    assert serve.nearest_rank(values, 0.5) == 0.5
    assert serve.nearest_rank([2.0], 0.9) == 2.0


# ---- --workload: the server under Poisson arrivals against HF static and continuous batches -------
LOAD = serve_load.LoadWorkload(
    vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, context=128, requests=5, rates=(20.0, 200.0),
    prompt_median=8, prompt_max=24, output_median=6, output_max=16, prefix_tokens=16, prefix_fraction=0.4, max_batch=3,
)  # fmt: skip


def test_bench_serve_workload_rows(tmp_path):
    """Every side (transformers 5.24's continuous batching included) answers every request with
    exactly the tokens it asked for, the same greedy tokens on each side, at both rates."""
    outcome = serve_load.run(LOAD)
    assert outcome.missing == {} and list(outcome.served) == [sides.TESSERA, sides.HF_STATIC, sides.HF_CB]
    asked = [r.max_tokens for r in outcome.requests[20.0]]
    assert [r.max_tokens for r in outcome.requests[200.0]] == asked  # the same lengths, other token ids
    assert [r.prompt for r in outcome.requests[200.0]] != [r.prompt for r in outcome.requests[20.0]]
    for by_rate in outcome.served.values():
        assert list(by_rate) == [20.0, 200.0]
        for rate, answers in by_rate.items():
            assert [len(a.tokens) for a in answers] == asked
            assert [a.tokens for a in answers] == [a.tokens for a in outcome.served[sides.HF_STATIC][rate]]
            assert all(0 < a.first <= a.last and 0 <= a.stall <= a.last - a.first for a in answers)
    data = check(serve_load.rows_of(LOAD, outcome), tmp_path, set(serve_load.METRICS))
    assert [(row["name"], row["metric"], row["anchor"]) for row in data] == [
        (f"load llama h32 l2 {rate}/s", metric, anchor)
        for rate in ("20", "200")
        for anchor in (sides.HF_STATIC, sides.HF_CB)
        for metric in serve_load.METRICS
    ]
    described = serve_load.describe(LOAD, outcome)
    assert "2 of 5 requests (0.4) start with the same 16-token system prompt" in described


def test_workload_requests_are_seeded_long_tailed_and_fit_the_context():
    w = dataclasses.replace(LOAD, requests=400, prompt_max=80, output_max=32, prefix_fraction=0.25)
    requests = serve_load.requests_of(w)
    assert requests == serve_load.requests_of(w)
    other = serve_load.requests_of(w, draw=1)
    assert [(len(r.prompt), r.max_tokens, r.shared, r.gap) for r in other] == [
        (len(r.prompt), r.max_tokens, r.shared, r.gap) for r in requests
    ]
    assert all(a.prompt[:16] == b.prompt[:16] for a, b in zip(requests, other) if a.shared)  # the system prompt
    assert sum(a.prompt[16 * a.shared :] != b.prompt[16 * b.shared :] for a, b in zip(requests, other)) > 390
    assert sum(r.shared for r in requests) == 100
    prefix = next(r.prompt[:16] for r in requests if r.shared)
    assert all(r.prompt[:16] == prefix for r in requests if r.shared)
    own = [len(r.prompt) - 16 * r.shared for r in requests]
    assert statistics.median(own) == pytest.approx(8, abs=2)
    assert 1 <= min(own) and 6 * statistics.median(own) <= max(own) <= 80  # a long tail, cut at prompt_max
    assert 2 <= min(r.max_tokens for r in requests) and max(r.max_tokens for r in requests) <= 32
    assert max(len(r.prompt) + r.max_tokens for r in requests) <= w.context
    slow, fast = serve_load.arrivals(requests, 2.0), serve_load.arrivals(requests, 8.0)
    assert slow[0] == 0.0 and slow == pytest.approx([4 * t for t in fast])
    assert slow[-1] / len(requests) == pytest.approx(0.5, rel=0.15)  # a mean gap of 1 / rate


def test_workload_metrics_of_hand_made_answers():
    answers = [
        serve_load.Served(arrival=0.0, first=0.5, last=2.5, tokens=[1] * 5),
        serve_load.Served(arrival=1.0, first=0.25, last=3.0, tokens=[1] * 12),
    ]
    got = serve_load.summary(answers)
    assert got["tokens_per_s"] == pytest.approx(17 / 4.0)  # first arrival 0, last completion 1 + 3
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (0.25, 0.5)
    assert (got["tpot_p50_s"], got["tpot_p99_s"]) == (0.25, 0.5)


def test_workload_refuses_a_side_that_generates_something_else():
    def answer(tokens):
        return serve_load.Served(0.0, 0.1, 0.2, tokens)

    same = {name: [answer([1, 2]), answer([3, 4])] for name in (sides.TESSERA, sides.HF_STATIC)}
    serve_load.check_same_tokens(2.0, same)
    with pytest.raises(RuntimeError, match="at 2 requests/s: .* prompt 1: tessera serve and HF static"):
        serve_load.check_same_tokens(2.0, same | {sides.TESSERA: [answer([1, 2]), answer([3, 5])]})


def test_workload_from_the_command_line():
    from tessera.cli import build_parser
    from tessera.errors import ConfigError

    flags = "--workload --rates 0.5,4 --requests 12 --set hidden=128 --set prefix_fraction=0"
    args = build_parser().parse_args(["bench", "serve", *flags.split()])
    w = serve_load.workload_of(args)
    assert (w.rates, w.requests, w.hidden, w.prefix_fraction) == ((0.5, 4.0), 12, 128, 0.0)
    refused = {
        "--set hiden=128": "KEY one of vocab, hidden",
        "--set layers=2.5": "layers takes an integer",
        "--set prompt_max=1000": "more than the model's context",
        "--rates 1,x": "--rates",
        "--rates 2,2": "distinct",
    }
    for bad, match in refused.items():
        with pytest.raises(ConfigError, match=match):
            serve_load.workload_of(build_parser().parse_args(["bench", "serve", "--workload", *bad.split()]))

    for flags in (["dp", "--workload"], ["serve", "--rates", "1"]):  # refused before anything runs
        args = build_parser().parse_args(["bench", *flags])
        with pytest.raises(ConfigError, match="--workload"):
            args.func(args)
