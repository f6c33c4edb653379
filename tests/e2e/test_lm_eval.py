"""lm-evaluation-harness against ``tessera serve``: its ``local-completions`` model gets the scores of
its own ``hf`` backend on the same model.

A tiny random LLaMA (fp32) and a byte-level BPE tokenizer trained on the tasks' text are written as
a Hugging Face folder. lm-eval runs the two tasks of tests/data/lm_eval (``tessera_choice``, multiple
choice: loglikelihood requests; ``tessera_complete``, greedy generation: generate_until requests)
twice: in this process with its ``hf`` backend, and with ``local-completions`` against ``tessera
serve`` on the folder (token-id prompts in batches, ``echo`` with ``logprobs``). The scores are equal
per task and metric, every request's summed loglikelihood agrees within 1e-4 and its ``is_greedy``
is the same, and every generation is the same text.

Equal scores follow from those only where no choice is too close to call, so the reference is
checked for that first: each document's winning choice (by loglikelihood, and by loglikelihood per
byte) leads by more than twice the tolerance, and each greedy token (generated, or a continuation
token's is-the-argmax) wins by more than the logits' rounding could move.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lm_eval  # the eval extra: a missing lm-eval fails this module, it does not skip it
import pytest
import torch
import transformers
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from tessera.testing import Draw, assert_draws_clear, greedy_draws
from tests.e2e.test_serve import free_port, wait_until_serving

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = {"tessera_choice": "choice", "tessera_complete": "complete"}  # task name -> its files' stem
NAME = "tiny-llama"
END = "<|end|>"  # the tokenizer's one special token: beginning and end of text
LAYERS = 2
# Largest difference allowed between the two backends' summed loglikelihood of one request (fp32).
LOGLIKELIHOOD_TOL = 1e-4


def write_model(folder: Path) -> None:
    """The tokenizer (byte-level BPE, 256 tokens, trained on the tasks' data) and a random LLaMA
    of its vocabulary, saved into ``folder`` as transformers writes them (safetensors, fp32)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # no initial alphabet: every token is ASCII text, so any sequence of them decodes exactly
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=[END], show_progress=False)
    tokenizer.train_from_iterator([p.read_text() for p in sorted(DATA.glob("*.jsonl"))], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END, eos_token=END)
    fast.save_pretrained(folder)
    end = fast.convert_tokens_to_ids(END)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=end, eos_token_id=end, pad_token_id=end,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # the end of text wins wherever " w" would (byte-level BPE's "Ġw"): some answers end
        model.lm_head.weight[end] = 1.1 * model.lm_head.weight[fast.convert_tokens_to_ids("\u0120w")]
    model.save_pretrained(folder)


def write_tasks(folder: Path) -> None:
    """The task YAMLs of tests/data/lm_eval with their data files' absolute paths (the shipped
    ones name them from the repository's root), so that lm-eval finds them from any directory."""
    folder.mkdir()
    for stem in TASKS.values():
        text = (DATA / f"{stem}.yaml").read_text()
        relative = f"tests/data/lm_eval/{stem}.jsonl"
        assert relative in text
        (folder / f"{stem}.yaml").write_text(text.replace(relative, str(DATA / f"{stem}.jsonl")))


def evaluate(model: Any, model_args: str | None, tasks: Path) -> dict[str, Any]:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm_eval") / NAME
    write_model(path)
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm_eval") / "tasks"
    write_tasks(path)
    return path


@pytest.fixture(scope="module")
def hf(folder) -> HFLM:
    return HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1)


@pytest.fixture(scope="module")
def reference(hf, tasks) -> dict[str, Any]:
    """lm-eval's own ``hf`` backend on the folder."""
    return evaluate(hf, None, tasks)


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    """``tessera serve`` on the folder: its completions URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "tessera.cli", "serve", str(folder), "--port", str(port), "--served-name", NAME]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path_factory.mktemp("serve"), stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, url, 120)
        yield url + "/v1/completions"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def through_server(served, folder, tasks) -> dict[str, Any]:
    """lm-eval's ``local-completions`` against the server: token-id prompts, four to a request."""
    model_args = (
        f"base_url={served},model={NAME},tokenizer_backend=huggingface,tokenizer={folder},"
        "tokenized_requests=True,batch_size=4,num_concurrent=1,max_retries=1,timeout=60"
    )
    return evaluate("local-completions", model_args, tasks)


def samples(results: dict[str, Any], task: str) -> dict[int, dict[str, Any]]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def test_the_reference_is_clear_and_meets_every_ending(hf, reference):
    """No score or token of the reference is too close to call (see the module docstring), and its
    requests end in every way a server must handle: a scored text the model would end (the token
    after an echoed prompt is the end of text), answers ended by the end of text (one at once: empty), by
    a stop string and by ``max_gen_toks``."""
    for doc in samples(reference, "tessera_choice").values():
        lls = torch.tensor([ll for ((ll, _),) in doc["resps"]])
        lengths = torch.tensor([float(len(c)) for c in doc["doc"]["choices"]])
        for name, scores, bound in (("acc", lls, 2 * LOGLIKELIHOOD_TOL), ("acc_norm", lls / lengths, 2 * LOGLIKELIHOOD_TOL / lengths.min())):  # fmt: skip
            top = scores.topk(2).values
            assert top[0] - top[1] > bound, f"document {doc['doc_id']}: {name}'s winner leads by {top[0] - top[1]:.2g}"

    draws: list[Draw] = []
    ended = 0
    for doc in samples(reference, "tessera_choice").values():
        for context_text, continuation_text in doc["arguments"]:
            context, continuation = hf._encode_pair(context_text, continuation_text)
            scored, after = continuation_draws(hf.model, context, continuation)
            draws += scored
            ended += after == hf.eot_token_id
    assert ended, "no scored text is followed by the end of text"

    generate = reference["configs"]["tessera_complete"]["generation_kwargs"]
    endings = []
    for doc in samples(reference, "tessera_complete").values():
        ((context_text, _),) = doc["arguments"]
        text, ending, generated = greedy_generation(hf, context_text, generate)
        assert text == doc["resps"][0][0], "a plain greedy loop and lm-eval's hf backend disagree"
        endings.append("empty" if text == "" else ending)
        draws += generated
    assert {"empty", "end of text", "stop", "length"} <= set(endings), endings
    assert_draws_clear(draws, blocks=LAYERS)


def continuation_draws(model: torch.nn.Module, context: list[int], continuation: list[int]) -> tuple[list[Draw], int]:
    """Whether each continuation token is the argmax (lm-eval's ``is_greedy``), as draws: the gap
    between the token's logit and the best other one; and the argmax after the continuation."""
    with torch.no_grad():
        logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1 :]
    draws = []
    for row, token in zip(logits, continuation):
        others = torch.cat([row[:token], row[token + 1 :]])
        draws.append(Draw(token, float((row[token] - others.max()).abs()), float(row.abs().max())))
    return draws, int(logits[-1].argmax())


def greedy_generation(hf: HFLM, context: str, kwargs: dict[str, Any]) -> tuple[str, str, list[Draw]]:
    """The greedy continuation of ``context`` by a loop of whole forwards, up to ``max_gen_toks``
    tokens, the end of text or a stop string (the text before it); how it ended; each token's draw."""
    tokens, draws, text, ending = hf.tok_encode(context), [], "", "length"
    start = len(tokens)
    for _ in range(kwargs["max_gen_toks"]):
        with torch.no_grad():
            logits = hf.model(torch.tensor([tokens])).logits[0, -1]
        draws += greedy_draws(logits)
        if int(logits.argmax()) == hf.eot_token_id:
            ending = "end of text"
            break
        tokens.append(int(logits.argmax()))
        text = hf.tok_decode(tokens[start:])
        if any(stop in text for stop in kwargs["until"]):
            ending = "stop"
            break
    for stop in kwargs["until"]:
        text = text.split(stop)[0]
    return text, ending, draws


def test_local_completions_scores_equal_the_hf_backends(reference, through_server):
    for task in TASKS:
        assert through_server["results"][task] == reference["results"][task], task


def test_every_loglikelihood_agrees_within_its_tolerance(reference, through_server):
    expected, got = samples(reference, "tessera_choice"), samples(through_server, "tessera_choice")
    assert got.keys() == expected.keys()
    for doc_id, doc in expected.items():
        assert got[doc_id]["arguments"] == doc["arguments"]
        pairs = zip(doc["arguments"], doc["resps"], got[doc_id]["resps"], strict=True)
        for (context, continuation), ((want, want_greedy),), ((ll, greedy),) in pairs:
            request = f"document {doc_id}, {context!r} + {continuation!r}"
            assert abs(ll - want) <= LOGLIKELIHOOD_TOL, f"{request}: {ll} through the server, {want} by hf"
            assert greedy == want_greedy, f"{request}: is_greedy {greedy} through the server, {want_greedy} by hf"


def test_every_generation_is_the_same_text(reference, through_server):
    expected, got = samples(reference, "tessera_complete"), samples(through_server, "tessera_complete")
    assert got.keys() == expected.keys()
    assert {i: s["resps"] for i, s in got.items()} == {i: s["resps"] for i, s in expected.items()}
