"""The OpenAI-compatible server (tessera.serve.app) over a fake backend, with real clients.

The fake answers each prompt with its bytes reversed and then its end-of-sequence token, one
token per 5 ms, so every expected text is known. One server runs for the module on a free
port of 127.0.0.1; tests that need other limits start their own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import httpx
import openai
import pytest

from tessera.errors import ConfigError
from tessera.inference.params import SamplingParams
from tessera.inference.text import ByteTokenizer
from tessera.serve.app import Limits, create_app
from tessera.serve.backend import Chunk, ModelInfo
from tessera.serve.http import check_host, serving, url_of
from tessera.serve.metrics import Counter, Histogram
from tessera.serve.protocol import ChatMessage
from tessera.serve.server import chat_prompt

EOS = 256
TOKEN_SECONDS = 0.005
API_KEY = "sk-test-key"
MODEL = "tiny-reverser"
CONTEXT = 400
LIMITS = Limits(max_prompt_tokens=200, max_tokens=300, max_concurrent_requests=48, max_body_bytes=32_768)


class FakeTokenizer(ByteTokenizer):
    """Bytes, plus an end-of-sequence id the fake backend emits (never decoded: the server
    passes it as a stop token id)."""

    eos_token_id = EOS


class ReversingBackend:
    """Answers a prompt with its bytes reversed, then EOS, cycling on when EOS is not a stop
    token; honours max_tokens; a prompt that starts with FAIL gets an engine error on its third
    token, one that starts with CRASH an exception there. Records every request's prompt, params and adapter, the aborts, and whether it was closed."""

    def __init__(self, adapters: tuple[str, ...] = ()) -> None:
        self.info = ModelInfo(name="reverser", max_model_len=CONTEXT, vocab_size=EOS + 1, adapters=adapters)
        self.tokenizer = FakeTokenizer()
        self.prompts: dict[str, bytes] = {}
        self.params: dict[str, SamplingParams] = {}
        self.adapters: dict[str, str | None] = {}
        self.aborted: set[str] = set()
        self.running = 0
        self.closed = False

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[Chunk]:
        self.prompts[request_id] = bytes(prompt_ids)
        self.params[request_id] = params
        self.adapters[request_id] = adapter
        self.running += 1
        try:
            script = [*reversed(prompt_ids), EOS]
            for step in range(params.max_tokens):
                await asyncio.sleep(TOKEN_SECONDS)
                if request_id in self.aborted:
                    return
                if self.prompts[request_id].startswith(b"CRASH") and step == 2:
                    raise RuntimeError("a bug in the backend")
                if self.prompts[request_id].startswith(b"FAIL") and step == 2:
                    yield Chunk((), "abort", error="the fake engine failed")
                    return
                token = script[step % len(script)]
                if token in params.stop_token_ids:
                    yield Chunk((), "stop")
                    return
                yield Chunk((token,), "length" if step == params.max_tokens - 1 else None)
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self) -> dict[str, float]:
        return {"running": self.running, "waiting": 0, "kv_blocks_used": 2 * self.running, "kv_blocks_total": 64}

    async def close(self) -> None:
        self.closed = True


@dataclass
class Served:
    url: str
    backend: ReversingBackend
    http: httpx.Client  # sends the API key
    openai: openai.OpenAI


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    backend = ReversingBackend()
    app = create_app(backend, served_name=MODEL, limits=LIMITS, api_key=API_KEY)
    with serving(app) as url:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
            client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)
            yield Served(url, backend, http, client)


def wait_for(condition, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def events_of(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


# The official client ---------------------------------------------------------------------------


def test_the_openai_client_gets_a_completion(served):
    answer = served.openai.completions.create(model=MODEL, prompt="hello", max_tokens=20, seed=3)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == MODEL
    assert answer.choices[0].text == "olleh" and answer.choices[0].finish_reason == "stop"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (5, 5, 10)
    params = served.backend.params[answer.id]
    assert (params.max_tokens, params.seed, params.stop_token_ids) == (20, 3, (EOS,))

    cut = served.openai.completions.create(model=MODEL, prompt=["hello"], max_tokens=3)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("oll", "length")


def test_the_openai_client_streams_a_chat_completion(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    stream = served.openai.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = plain_chat_prompt(messages).encode()
    assert text == prompt[::-1].decode("utf-8", errors="replace")  # é's bytes reversed are not UTF-8
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(prompt)


def test_a_chat_completion_without_streaming(served):
    answer = served.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=4
    )
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant"
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (" :tn", "length")


def test_models_and_health(served):
    assert [m.id for m in served.openai.models.list()] == [MODEL]
    assert served.openai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        served.openai.models.retrieve("gpt-4")
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_a_prompt_of_token_ids(served):
    answer = served.http.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 5}).json()
    assert answer["choices"][0]["text"] == "ih"


# Stop strings --------------------------------------------------------------------------------


def test_stop_strings_cut_the_text_and_abort_the_request(served):
    answer = served.openai.completions.create(model=MODEL, prompt="abcdefgh", max_tokens=50, stop=["dc", "zz"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("hgfe", "stop")
    assert answer.id in served.backend.aborted
    assert served.backend.params[answer.id].stop == ("dc", "zz")

    stream = served.openai.completions.create(model=MODEL, prompt="abcdefgh", max_tokens=50, stop="c", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "hgfed"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].id in served.backend.aborted


# Refusals ------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "bad JSON": ("/v1/completions", b'{"prompt": "x",', 400, "not valid JSON"),
    "not an object": ("/v1/completions", [1, 2], 400, "must be a JSON object"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt is required"),
    "prompt of a wrong type": ("/v1/completions", {"prompt": 5}, 400, "prompt must be a string"),
    "an empty prompt in a list": ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "a prompt of token ids is empty"),
    "long prompt": (
        "/v1/completions",
        {"prompt": "x" * 201},
        400,
        "the prompt has 201 tokens; this server takes at most 200",
    ),
    "beyond the context": (
        "/v1/completions",
        {"prompt": "x" * 150, "max_tokens": 300},
        400,
        "context is 400 tokens; the prompt has 150 and max_tokens asks for 300",
    ),
    "max_tokens over the cap": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 301},
        400,
        "max_tokens=301 is more than this server allows (300)",
    ),
    "max_tokens of 0 without echo": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "with echo=true"),
    "max_tokens of 0 in a chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
        "max_tokens=0 must be at least 1",
    ),
    "bad temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature=-1"),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 999]}, 400, "999 is outside the vocabulary"),
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, f"serves '{MODEL}'"),
    "n above the limit": ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n=17: this server returns 1 to 16"),
    "n of 0": ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n=0"),
    "more choices than allowed": ("/v1/completions", {"prompt": ["x"] * 9, "n": 8}, 400, "9 prompts x n=8"),
    "logprobs above 20": ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs=21"),
    "top_logprobs above 20": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs=21",
    ),
    "top_logprobs without logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "needs logprobs=true",
    ),
    "a token id in a list outside the vocabulary": (
        "/v1/completions",
        {"prompt": [[1, 2], [3, 999]]},
        400,
        "999 is outside the vocabulary",
    ),
    "logit_bias outside the vocabulary": ("/v1/completions", {"prompt": "x", "logit_bias": {"999": 1}}, 400, "999"),
    "logit_bias out of range": ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, 400, "[-100, 100]"),
    "penalty out of range": ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "[-2, 2]"),
    "best_of above n": ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of=3"),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
    "unknown field": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        400,
        "unknown field 'tools'",
    ),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "bad role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    "image part": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "only text content parts",
    ),
    "body too large": ("/v1/completions", {"prompt": "x" * 40_000}, 413, "at most 32768"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_a_bad_request_gets_an_openai_error_and_the_server_stays_up(served, case):
    path, body, status, message = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = served.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = served.http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert served.http.get("/health").status_code == 200


def test_the_api_key_is_required_except_for_health(served):
    body = {"prompt": "ab", "max_tokens": 2}
    missing = httpx.post(served.url + "/v1/completions", json=body)
    wrong = httpx.post(served.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert "missing API key" in missing.json()["error"]["message"]
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/metrics").status_code == 401
    assert httpx.get(served.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert served.http.post("/v1/completions", json=body).json()["choices"][0]["text"] == "ba"


def test_an_unknown_path_gets_an_openai_404(served):
    response = served.http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


# Engine errors -------------------------------------------------------------------------------


def test_an_engine_error_is_a_500_or_an_error_event(served):
    response = served.http.post("/v1/completions", json={"prompt": "FAIL now", "max_tokens": 10})
    assert response.status_code == 500
    assert "the fake engine failed" in response.json()["error"]["message"]

    with served.http.stream("POST", "/v1/completions", json={"prompt": "FAIL now", "stream": True}) as streamed:
        events = list(events_of(streamed.iter_lines()))
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["w", "o"]
    assert "the fake engine failed" in json.loads(events[2])["error"]["message"]
    assert events[3:] == ["[DONE]"]
    with pytest.raises(openai.APIError, match="the fake engine failed"):
        list(served.openai.completions.create(model=MODEL, prompt="FAIL", stream=True))


def test_an_exception_in_the_backend_is_a_500_and_the_server_goes_on(served):
    response = served.http.post("/v1/completions", json={"prompt": "CRASH", "max_tokens": 10})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal server error (RuntimeError); see the server's log"
    with served.http.stream("POST", "/v1/completions", json={"prompt": "CRASH", "stream": True}) as streamed:
        events = list(events_of(streamed.iter_lines()))
    assert "internal server error (RuntimeError)" in json.loads(events[-2])["error"]["message"]
    assert events[-1] == "[DONE]" and served.http.get("/health").status_code == 200


# Clients that leave --------------------------------------------------------------------------


def test_a_streamed_client_that_leaves_aborts_its_request(served):
    body = {"prompt": "a" * 100, "max_tokens": 300, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        events = events_of(response.iter_lines())
        request_id = json.loads(next(events))["id"]
        next(events)
    # leaving the block closed the connection mid-stream (300 tokens take 1.5 s)
    assert wait_for(lambda: request_id in served.backend.aborted)
    assert wait_for(lambda: served.backend.running == 0 and served.http.get("/health").status_code == 200)
    in_flight = served.http.get("/metrics").text
    assert "tessera_http_requests_in_flight 0" in in_flight


def test_a_client_that_leaves_before_a_whole_answer_aborts_its_request(served):
    prompt = "left before the answer " * 4
    with pytest.raises(httpx.ReadTimeout):
        served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 300}, timeout=0.2)
    ids = [rid for rid, p in served.backend.prompts.items() if p == prompt.encode()]
    assert len(ids) == 1 and wait_for(lambda: ids[0] in served.backend.aborted)
    assert wait_for(lambda: served.backend.running == 0)


# Load ----------------------------------------------------------------------------------------


def test_32_concurrent_clients_all_get_their_answers(served):
    async def ask(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
        prompt = f"client number {i:02d}"
        if i % 2:  # half of them streamed
            body = {"prompt": prompt, "max_tokens": 50, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                pieces = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            return prompt, "".join(json.loads(p.removeprefix("data: "))["choices"][0]["text"] for p in pieces)
        answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 50})
        return prompt, answer.json()["choices"][0]["text"]

    async def ask_all() -> list[tuple[str, str]]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=10, limits=limits) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(32)))

    answers = asyncio.run(ask_all())
    assert [text for _, text in answers] == [prompt[::-1] for prompt, _ in answers]


def test_more_concurrent_requests_than_allowed_get_429():
    backend = ReversingBackend()
    app = create_app(backend, served_name=MODEL, limits=Limits(max_concurrent_requests=1))
    with serving(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"prompt": "x" * 60, "max_tokens": 60, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            refused = http.post("/v1/completions", json={"prompt": "y"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert wait_for(lambda: http.post("/v1/completions", json={"prompt": "yz"}).status_code == 200)
    assert backend.closed  # the app closes its backend at shutdown


# Metrics -------------------------------------------------------------------------------------


def metric(page: str, name: str) -> float:
    lines = [line for line in page.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_metrics_count_requests_tokens_and_show_the_engine(served):
    ok = 'tessera_requests_total{endpoint="/v1/completions",status="200"}'
    bad = 'tessera_requests_total{endpoint="/v1/completions",status="400"}'
    before = served.http.get("/metrics").text
    served.http.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3})
    served.http.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 0})
    after = served.http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain; version=0.0.4")
    page = after.text
    assert metric(page, ok) - metric(before, ok) == 1 and metric(page, bad) - metric(before, bad) == 1
    assert metric(page, "tessera_prompt_tokens_total") - metric(before, "tessera_prompt_tokens_total") == 4
    assert metric(page, "tessera_generation_tokens_total") - metric(before, "tessera_generation_tokens_total") == 3
    latency = "tessera_request_latency_seconds_count"
    assert metric(page, latency) - metric(before, latency) == 1
    assert metric(page, 'tessera_time_to_first_token_seconds_bucket{le="+Inf"}') >= 1
    assert "# TYPE tessera_requests_total counter" in page
    assert "# TYPE tessera_request_latency_seconds histogram" in page
    assert metric(page, "tessera_kv_blocks_capacity") == 64 and "tessera_requests_waiting 0" in page


def test_the_metric_types_render_the_prometheus_text_format():
    counter = Counter("c_total", "a count", ("path",))
    counter.inc(path='a"b')
    counter.inc(2, path='a"b')
    assert counter.render()[2:] == ['c_total{path="a\\"b"} 3']
    with pytest.raises(ValueError, match="takes labels"):
        counter.inc(other="x")
    histogram = Histogram("h_seconds", "times", (0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        histogram.observe(value)
    assert histogram.render()[2:] == [
        'h_seconds_bucket{le="0.1"} 1',
        'h_seconds_bucket{le="1"} 3',
        'h_seconds_bucket{le="+Inf"} 4',
        "h_seconds_sum 6.25",
        "h_seconds_count 4",
    ]


# Pieces --------------------------------------------------------------------------------------


class TemplatedTokenizer(FakeTokenizer):
    chat_template = "{{ messages }}"

    def apply_chat_template(self, conversation, tokenize: bool, add_generation_prompt: bool) -> str:
        assert (tokenize, add_generation_prompt) == (False, True)
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + super().encode(text)


def test_a_chat_template_makes_the_prompt_when_the_tokenizer_has_one():
    messages = [ChatMessage(role="user", content="hi")]
    assert bytes(chat_prompt(TemplatedTokenizer(), messages)) == b"<user>hi<assistant>"  # no second BOS
    assert bytes(chat_prompt(FakeTokenizer(), messages)) == b"user: hi\nassistant: "


def test_check_host_refuses_a_public_host_unless_named():
    assert check_host("127.0.0.1", explicit=False) is None
    assert check_host("::1", explicit=False) is None and check_host("localhost", explicit=False) is None
    with pytest.raises(ConfigError, match="refusing to listen on '0.0.0.0'"):
        check_host("0.0.0.0", explicit=False)
    assert "every network interface" in check_host("0.0.0.0", explicit=True)
    assert url_of("::1", 8000) == "http://[::1]:8000"


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="max_tokens=0"):
        Limits(max_tokens=0)


def test_a_requests_model_picks_its_lora_adapter_and_models_lists_them():
    backend = ReversingBackend(adapters=("sql", "poems"))
    with serving(create_app(backend, served_name=MODEL, limits=LIMITS)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
        cards = client.models.list().data
        assert [m.id for m in cards] == [MODEL, "sql", "poems"]
        assert [getattr(m, "parent", None) for m in cards] == [None, MODEL, MODEL]
        answers = {
            name: client.completions.create(model=name, prompt=name, max_tokens=3) for name in (MODEL, "sql", "poems")
        }
        chat = client.chat.completions.create(model="poems", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError) as error:
            client.completions.create(model="prose", prompt="x", max_tokens=1)
        assert httpx.get(url + "/v1/models/sql").json()["parent"] == MODEL
        assert httpx.get(url + "/v1/models/prose").status_code == 404
    assert {backend.adapters[a.id] for a in answers.values()} == {None, "sql", "poems"}
    assert all(backend.adapters[a.id] == (None if a.model == MODEL else a.model) for a in answers.values())
    assert backend.adapters[chat.id] == "poems" and chat.model == "poems"
    message = error.value.response.json()["error"]["message"]
    assert f"serves '{MODEL}' and its adapters 'sql', 'poems'" in message
