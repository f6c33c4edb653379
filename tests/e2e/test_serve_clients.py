"""What real clients ask of ``tessera serve``, with the official ``openai`` client against the real
engine (a tiny byte-level GPT on one rank), checked against the same model in this process:

- ``n`` with a seed: different completions, each the completion of ``n=1`` with that sequence's
  seed (``seed + j``);
- ``logprobs`` (completions) and ``logprobs``/``top_logprobs`` (chat): a log-softmax of the
  model's logits at each position, the most likely alternatives in order;
- ``echo`` with ``max_tokens=0``: the prompt scored, its first token without a logprob;
- several prompts (token ids) in one request, ``n`` choices each, numbered prompt by prompt;
- ``stream_options.include_usage``: the counts of the tokenizer;
- prefix caching: 16 requests sharing a 512-token system prompt compute its blocks once (the hit
  rate on ``/metrics``) and answer the model's own greedy tokens;
- bad values of the new fields: a 4xx naming them, and the server goes on serving.
"""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import fastapi  # noqa: F401 -- the serve extra, installed by the test extra
import httpx
import pytest
import torch

from tessera.inference.text import ByteTokenizer
from tessera.models.gpt import gpt
from tessera.testing import assert_draws_clear, greedy_draws
from tests.e2e.test_serve import client, save_weights

NAME = "tiny-gpt"
OPTIONS = dict(n_layers=2, max_seq_len=640)
BYTES = ByteTokenizer()
SYSTEM = ("You are a careful assistant. Answer briefly and kindly. " * 10)[:512]


def reference_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return gpt("tiny", **OPTIONS).eval()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return reference_model()


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return save_weights(reference_model(), tmp_path_factory.mktemp("clients"))


@pytest.fixture(scope="module")
def urls(weights, tmp_path_factory):
    """The server over one rank, with the prefix cache (and the KV blocks of several requests)."""
    from tessera.serve.app import Limits, create_app
    from tessera.serve.http import serving
    from tessera.serve.ranks import EngineOptions, RankBackend
    from tessera.serve.sources import ModelSource

    source = ModelSource("gpt", name=NAME, preset="tiny", options=OPTIONS, init=str(weights))
    limits = Limits(max_prompt_tokens=600, max_tokens=40, max_concurrent_requests=40)
    options = EngineOptions(num_blocks=640, block_size=16, max_prefill_tokens=128)
    backend = RankBackend(source, options, log_dir=tmp_path_factory.mktemp("logs")).start()
    with serving(create_app(backend, served_name=NAME, limits=limits)) as url:
        yield (url,)


def log_softmax(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens]))[0].float(), dim=-1)


def greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """The greedy continuation, each choice clear of a tie by more than rounding could move."""
    tokens, draws = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens]))[0, -1]
            draws += greedy_draws(logits)
            tokens.append(int(logits.argmax()))
    assert_draws_clear(draws, blocks=OPTIONS["n_layers"])
    return tokens[len(prompt) :]


def top_dict(row: torch.Tensor, k: int, chosen: int) -> dict[str, float]:
    """OpenAI's ``top_logprobs`` entry of a completion: the k most likely tokens' text and the chosen one."""
    values, ids = row.sort(descending=True, stable=True)
    out = {BYTES.decode([int(t)]): float(v) for t, v in zip(ids[:k], values[:k])}
    out.setdefault(BYTES.decode([chosen]), float(row[chosen]))
    return out


def test_n_with_a_seed_gives_different_completions_each_its_seed_alone(urls):
    c = client(urls[0])
    many = c.completions.create(model=NAME, prompt="Once upon", n=4, seed=11, temperature=1.0, max_tokens=10)
    texts = [choice.text for choice in sorted(many.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(many.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    for j, text in enumerate(texts):
        one = c.completions.create(model=NAME, prompt="Once upon", seed=11 + j, temperature=1.0, max_tokens=10)
        assert one.choices[0].text == text
    assert many.usage.prompt_tokens == len(BYTES.encode("Once upon")) and many.usage.completion_tokens == 40


def test_completion_logprobs_are_a_log_softmax_of_the_models_logits(urls, model):
    prompt = "The quick brown fox"
    ids = BYTES.encode(prompt)
    out = client(urls[0]).completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.0, logprobs=5)
    made = greedy(model, ids, 8)
    want = log_softmax(model, ids + made)
    lp = out.choices[0].logprobs
    assert lp.tokens == [BYTES.decode([t]) for t in made]
    assert lp.token_logprobs == pytest.approx([float(want[len(ids) - 1 + k, t]) for k, t in enumerate(made)], abs=1e-5)
    for k, (top, token) in enumerate(zip(lp.top_logprobs, made)):
        expected = top_dict(want[len(ids) - 1 + k], 5, token)
        assert top.keys() == expected.keys()
        assert [top[key] for key in expected] == pytest.approx(list(expected.values()), abs=1e-5)
    assert lp.text_offset == [sum(len(BYTES.decode([t])) for t in made[:k]) for k in range(8)]


def test_chat_logprobs_and_top_logprobs(urls, model):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client(urls[0]).chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5
    )
    ids = BYTES.encode("user: Name a colour.\nassistant: ")  # the template a tokenizer without one gets
    made = greedy(model, ids, 6)
    want = log_softmax(model, ids + made)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [BYTES.decode([t]) for t in made]
    for k, (entry, token) in enumerate(zip(content, made)):
        row = want[len(ids) - 1 + k]
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-5)
        values, top_ids = row.sort(descending=True, stable=True)
        assert [t.token for t in entry.top_logprobs] == [BYTES.decode([int(t)]) for t in top_ids[:5]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values[:5].tolist(), abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_echo_with_no_new_tokens_scores_the_prompt(urls, model):
    ids = BYTES.encode("Scoring this sentence word by word, " * 6)  # several prefill chunks
    out = client(urls[0]).completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    want = log_softmax(model, ids)
    assert out.choices[0].text == BYTES.decode(ids) and out.choices[0].finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(want[i, t]) for i, t in enumerate(ids[1:])], abs=1e-5)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0


def test_token_prompts_in_one_request_get_n_choices_each_in_order(urls):
    c = client(urls[0])
    prompts = [BYTES.encode("red and"), BYTES.encode("one, two,")]
    out = c.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=5, temperature=0.0)
    texts = [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=5, temperature=0.0).choices[0].text for p in prompts]
    assert texts == [alone[0], alone[0], alone[1], alone[1]]
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 20


def test_include_usage_reports_the_tokenizers_counts(urls):
    c = client(urls[0])
    prompt = "Count these bytes: äöü"
    chunks = list(
        c.completions.create(
            model=NAME, prompt=prompt, max_tokens=7, temperature=0.0, logprobs=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert usage.prompt_tokens == len(BYTES.encode(prompt)) == len(prompt.encode())
    assert usage.completion_tokens == len(tokens) == 7
    chat = list(
        c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chat[-1].usage.prompt_tokens == len(BYTES.encode(f"user: {prompt}\nassistant: "))
    assert chat[-1].usage.completion_tokens == 3


def prefix_counters(url: str) -> tuple[float, float]:
    page = httpx.get(f"{url}/metrics").text
    hits = float(re.search(r"^tessera_prefix_cache_hit_blocks (\S+)$", page, re.M).group(1))
    queried = float(re.search(r"^tessera_prefix_cache_queried_blocks (\S+)$", page, re.M).group(1))
    return hits, queried


def test_a_shared_system_prompt_is_computed_once_and_answers_as_without_the_cache(urls, model):
    """The 16 requests' tokens are the model's own greedy ones (each computed whole, in this
    process: what the server without the cache gives; tests/unit/test_inference_scheduling.py
    compares the engine with the cache on and off)."""
    cached = urls[0]
    assert len(BYTES.encode(SYSTEM)) == 512  # 32 blocks of 16
    prompts = [SYSTEM + f"Q{i}: hi?" for i in range(16)]  # under 16 tokens each after it

    def ask(prompt: str) -> str:
        return (
            client(cached).completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0.0).choices[0].text
        )

    hits, queried = prefix_counters(cached)
    first = ask(prompts[0])  # computes the system prompt's blocks
    with concurrent.futures.ThreadPoolExecutor(15) as pool:
        rest = list(pool.map(ask, prompts[1:]))
    hits, queried = (a - b for a, b in zip(prefix_counters(cached), (hits, queried)))
    assert queried == 16 * 32
    assert hits / queried >= 15 / 16  # every request after the first found all 32 blocks
    assert [first, *rest] == [BYTES.decode(greedy(model, BYTES.encode(p), 4)) for p in prompts]
    page = httpx.get(f"{cached}/metrics").text
    for gauge in (
        "tessera_prefix_cache_hit_rate",
        "tessera_preemptions",
        "tessera_requests_waiting",
        "tessera_step_tokens",
    ):
        assert re.search(rf"^{gauge} \S+$", page, re.M), gauge


BAD = {
    "n above the limit": ({"prompt": "x", "n": 17}, "n=17"),
    "top_logprobs above 20": (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs=21",
    ),
    "logprobs above 20": ({"prompt": "x", "logprobs": 21}, "logprobs=21"),
    "a token id outside the vocabulary": ({"prompt": [[1, 2], [300]]}, "300 is outside the vocabulary"),
    "max_tokens=0 without echo": ({"prompt": "x", "max_tokens": 0}, "max_tokens=0"),
    "logit_bias outside the vocabulary": ({"prompt": "x", "logit_bias": {"256": 5}}, "256"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_values_of_the_new_fields_get_a_4xx_and_the_server_serves_on(urls, case):
    body, message = BAD[case]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{urls[0]}{path}", json={"model": NAME, **body}, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert message in response.json()["error"]["message"]
    ok = client(urls[0]).completions.create(model=NAME, prompt="still", max_tokens=2, temperature=0.0)
    assert ok.choices[0].finish_reason == "length"
