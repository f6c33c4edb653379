"""``tessera serve`` with a base and two LoRA adapter folders, called by the ``openai`` client;
``tessera generate --adapter``.

A small random LLaMA (a transformers folder, bytes for tokens) and two PEFT adapters of
different ranks and targets with non-zero factors (tests/unit/test_lora_serving.py makes them).
Under each adapter's name the server answers with the greedy tokens of PEFT's
``merge_and_unload`` of that adapter (a plain loop over the merged transformers model), under the
base's name with the base's; the same answers come back when clients of the three names ask at
once (their sequences share the engine's steps); an unknown name gets OpenAI's 404.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import fastapi  # noqa: F401 -- the serve extra, installed by the test extra
import openai
import pytest

from tessera.inference.text import ByteTokenizer
from tests.e2e.test_serve import free_port, wait_until_serving
from tests.unit.test_lora_serving import greedy_loop, make_folders, merged

BASE = "tiny-llama"
TEXTS = ["Hello, ", "The", "x = 4"]
NEW = 12
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return make_folders(tmp_path_factory.mktemp("serve-adapters"))


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, dict[str, str]]:
    """name -> prompt -> the merged model's greedy text (the base under its served name)."""
    tokens = ByteTokenizer()
    out = {}
    for name, adapter in ((BASE, None), ("alpha", "alpha"), ("beta", "beta")):
        outs = greedy_loop(merged(folders, adapter), [tokens.encode(t) for t in TEXTS], NEW)
        out[name] = {text: tokens.decode(ids) for text, ids in zip(TEXTS, outs)}
    assert len({tuple(texts.values()) for texts in out.values()}) == 3  # the adapters change the answers
    return out


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    """The URL of ``tessera serve BASE --served-name tiny-llama --adapter alpha=FOLDER --adapter FOLDER``
    (the second named by its folder, ``beta``), on one rank (tests/dist/test_lora_serving.py runs
    the same engine under tensor and pipeline parallelism: a second rank here would double the
    start-up time)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tessera.cli", "serve", str(folders["base"]), "--served-name", BASE]
    cmd += ["--adapter", f"alpha={folders['alpha']}", "--adapter", str(folders["beta"])]
    cmd += ["--port", str(port), "--kv-blocks", "64", "--block-size", "8"]
    cwd = tmp_path_factory.mktemp("serve-run")
    proc = subprocess.Popen(cmd, env=ENV, cwd=cwd, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, 120)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def complete(url: str, name: str, text: str) -> str:
    answer = client(url).completions.create(model=name, prompt=text, max_tokens=NEW, temperature=0)
    assert answer.model == name and answer.usage.completion_tokens == NEW
    return answer.choices[0].text


def test_the_models_are_the_base_and_each_adapter(server):
    cards = client(server).models.list().data
    assert [m.id for m in cards] == [BASE, "alpha", "beta"]
    assert [getattr(m, "parent", None) for m in cards] == [None, BASE, BASE]


def test_each_adapters_name_gets_the_greedy_tokens_of_that_adapter_merged(server, expected):
    for name in (BASE, "alpha", "beta"):
        assert [complete(server, name, text) for text in TEXTS] == [expected[name][t] for t in TEXTS]


def test_clients_of_the_three_names_at_once_get_the_same_answers(server, expected):
    asks = [(name, text) for text in TEXTS for name in (BASE, "alpha", "beta")] * 2
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: complete(server, *ask), asks))
    assert answers == [expected[name][text] for name, text in asks]


def test_an_unknown_name_gets_a_404_that_names_the_adapters(server):
    with pytest.raises(openai.NotFoundError) as error:
        client(server).completions.create(model="gamma", prompt="x", max_tokens=1)
    assert "serves 'tiny-llama' and its adapters 'alpha', 'beta'" in error.value.response.json()["error"]["message"]
    assert complete(server, "alpha", TEXTS[0])  # still serving


def test_tessera_generate_runs_a_prompt_with_an_adapter(folders, expected, tmp_path):
    cmd = [sys.executable, "-m", "tessera.cli", "generate", str(folders["base"]), "--adapter", str(folders["beta"])]
    cmd += ["--prompt", TEXTS[1], "--max-tokens", str(NEW)]
    out = subprocess.run(cmd, env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == TEXTS[1] + expected["beta"][TEXTS[1]] + "\n"
