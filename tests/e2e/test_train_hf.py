"""`tessera train --model hf:PATH` as a user runs it: a tiny LLaMA folder fine-tuned under 1d tensor
parallelism on the byte corpus, a GPT-2 config with its folder's tokenizer trained from random
weights on text files, each written back as a folder plain transformers loads; and the errors
that stop a run before any process starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tessera.cli
from tessera.config import DataConfig, default_run_dir, load_config
from tessera.hf.train import tokens_of
from tessera.train import corpus_bytes
from tests.e2e.test_cli import run, run_together, tessera_cmd

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--set", "trainer.steps=6", "--set", "trainer.log_every=2", "--set", "trainer.eval_every=3",
         "--set", "trainer.progress_bar=false", "--set", "data.seq_len=32", "--set", "data.micro_batch_size=4",
         "--set", "optimizer.lr=1e-2", "--set", "schedule.warmup_steps=0"]  # fmt: skip


def llama_config(vocab_size: int = 260) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def write_llama(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny LLaMA (vocabulary 260: the bytes fit) saved by transformers; its weights."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    model.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def write_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of 300 tokens trained on tessera's own source, saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"],
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator([(REPO / "tessera" / "train.py").read_text()], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")
    fast.save_pretrained(folder)
    return fast


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in lines if "final" not in m]


def loss_on(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def folder_command(tmp_path: Path) -> list[str]:
    write_llama(tmp_path / "llama")
    return [*tessera_cmd(), "train", "--model", f"hf:{tmp_path / 'llama'}", "--nproc", "2",
            "--output-dir", str(tmp_path / "run"), "--set", "parallel.tensor.size=2", "--set", "data.max_bytes=30000",
            *SHORT]  # fmt: skip


def tokenizer_command(tmp_path: Path) -> list[str]:
    folder = tmp_path / "gpt2"
    tokenizer = write_tokenizer(folder)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=end,
                            eos_token_id=end).save_pretrained(folder)  # fmt: skip
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_bytes((REPO / "tessera" / "train.py").read_bytes())
    (texts / "b.py").write_bytes((REPO / "tessera" / "hf" / "train.py").read_bytes())
    config = tmp_path / "finetune.py"
    config.write_text(f"model = dict(name={'hf:' + str(folder)!r})\nlaunch = dict(nproc_per_node=1)\n")
    return [*tessera_cmd(), "train", str(config), "--data", str(texts), "--output-dir", str(tmp_path / "run"), *SHORT]


def adapters_command(tmp_path: Path) -> list[str]:
    write_llama(tmp_path / "llama")
    return [*tessera_cmd(), "train", "--model", f"hf:{tmp_path / 'llama'}", "--nproc", "2",
            "--output-dir", str(tmp_path / "run"), "--set", "parallel.tensor.size=2", "--set", "data.max_bytes=30000",
            "--set", "lora.rank=4", "--set", "lora.alpha=64", "--set", "lora.targets=['q_proj','v_proj','down_proj']",
            *SHORT]  # fmt: skip


def gpt_lora_command(tmp_path: Path) -> list[str]:
    return [*tessera_cmd(), "train", "--nproc", "2", "--output-dir", str(tmp_path / "run"), "--set", "parallel.data=2",
            "--set", "zero.stage=3", "--set", "data.max_bytes=30000", "--set", "lora.rank=4",
            "--set", "lora.quantize=nf4", *SHORT]  # fmt: skip


LAUNCHES = {"folder": folder_command, "tokenizer": tokenizer_command, "adapters": adapters_command,
            "gpt-lora": gpt_lora_command}  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The module's four training runs, their inputs written first, started together (independent
    launches): by name, the folder they ran in and their output."""
    folders = {name: tmp_path_factory.mktemp(name) for name in LAUNCHES}
    outs = run_together(*(make(folders[name]) for name, make in LAUNCHES.items()), timeout=300)
    return {name: (folders[name], out) for name, out in zip(LAUNCHES, outs)}


def test_a_folder_is_fine_tuned_under_tensor_parallelism_and_saved_for_transformers(launched):
    tmp_path, out = launched["folder"]
    start = dict(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").state_dict())
    run_dir = tmp_path / "run"
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LlamaForCausalLM" in out.stderr and "byte ids" in out.stderr and "on 2 rank(s)" in out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "hf", "loss.png", "metrics.jsonl"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["name"] == f"hf:{tmp_path / 'llama'}" and config["parallel"]["tensor"]["size"] == 2
    trained = losses(run_dir)
    assert len(trained) == 6 and trained[-1] < trained[0] - 0.3, trained

    # the saved folder is plain transformers': same keys and shapes, every tensor moved, a lower loss
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in start.items()}
    unchanged = [k for k in start if torch.equal(state[k], start[k])]
    assert not unchanged, unchanged
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    text = torch.tensor(list((REPO / "tessera" / "train.py").read_bytes()[:2048]), dtype=torch.int64)[None]
    assert loss_on(model, text) < loss_on(before, text) - 0.3


def test_a_config_with_its_tokenizer_trains_from_random_weights_on_text_files(launched):
    tmp_path, out = launched["tokenizer"]
    folder, texts, run_dir = tmp_path / "gpt2", tmp_path / "texts", tmp_path / "run"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GPT2LMHeadModel" in out.stderr and "random weights, its tokenizer" in out.stderr
    recorded = json.loads((run_dir / "config.json").read_text())["data"]
    assert recorded["name"] == "text_files" and recorded["files"] == [str(texts)]
    trained = losses(run_dir)
    assert trained[0] == pytest.approx(float(torch.log(torch.tensor(320.0))), abs=0.3), "the model's own init"
    assert trained[-1] < trained[0] - 0.3, trained

    saved = run_dir / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in saved.iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    reloaded = transformers.AutoTokenizer.from_pretrained(saved)
    assert type(model).__name__ == "GPT2LMHeadModel" and len(reloaded) == len(tokenizer)
    ids = torch.tensor(reloaded((REPO / "tessera" / "train.py").read_text()[:3000])["input_ids"][:64])[None]
    random_start = transformers.AutoModelForCausalLM.from_config(model.config)
    assert loss_on(model, ids) < loss_on(random_start, ids) - 0.3


def test_text_files_are_read_in_path_order_and_tokenized_by_the_folders_tokenizer(tmp_path):
    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "b.txt").write_text("second")
    (texts / "a.txt").write_text("first")
    (texts / "sub" / "c.txt").write_text("third")
    (texts / ".hidden").write_text("never")
    data = DataConfig(name="text_files", files=[str(texts)], max_bytes=1000)
    assert bytes(corpus_bytes(data).numpy()) == b"first\nsecond\nthird"
    assert bytes(corpus_bytes(DataConfig(name="text_files", files=[str(texts)], max_bytes=8)).numpy()) == b"first\nse"
    tokenizer = write_tokenizer(tmp_path / "tok")
    ids = tokens_of(corpus_bytes(data), tokenizer)
    assert ids.dtype == torch.int64 and tokenizer.decode(ids.tolist()) == "first\nsecond\nthird"
    assert tokens_of(corpus_bytes(data), None).tolist() == list(b"first\nsecond\nthird")  # no tokenizer: bytes


def test_the_run_folder_is_named_after_the_model():
    assert default_run_dir(load_config({"model": {"name": "hf:models/tiny-llama/"}})).name.endswith("-hf-tiny-llama")
    assert default_run_dir(load_config({"model": {"name": "hf:x/llama/config.json"}})).name.endswith("-hf-llama")
    assert default_run_dir(load_config({"model": {"name": "hf:x/my-gpt.json"}})).name.endswith("-hf-my-gpt")


# ---- errors, before any process starts ----------------------------------------------------


def train_error(capsys, *argv: str) -> str:
    """The error ``tessera train ARGV`` stops with (exit code 2) before starting any rank."""
    assert tessera.cli.main(["train", "--nproc", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera train: error: "), err
    return err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    write_llama(root / "llama")
    llama_config(vocab_size=200).save_pretrained(root / "small_vocab")
    transformers.T5Config(vocab_size=300, d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(root / "t5")
    (root / "no_config").mkdir()
    (root / "pickled").mkdir()
    llama_config().save_pretrained(root / "pickled")
    (root / "pickled" / "pytorch_model.bin").write_bytes(b"not read")
    write_llama(root / "mismatch")
    narrower = llama_config()
    narrower.intermediate_size = 48
    narrower.save_pretrained(root / "mismatch")  # the weights' MLPs are 64 wide
    write_tokenizer(root / "big_tokenizer")
    llama_config(vocab_size=280).save_pretrained(root / "big_tokenizer")
    return root


@pytest.mark.parametrize(
    ("case", "extra", "message"),
    [
        ("missing", [], "missing does not exist; give a local folder with config.json"),
        ("no_config", [], "the folder {root}/no_config has no config.json"),
        ("t5", [], "describes a 't5' model (T5Config), which is not a causal language model"),
        ("small_vocab", [], "vocab_size=200 is below 256. Without a tokenizer in the folder"),
        ("big_tokenizer", [], "the tokenizer in {root}/big_tokenizer has 300 tokens, more than the model's vocab_size=280"),
        ("pickled", [], "has weights only as pytorch_model.bin; tessera reads safetensors"),
        ("mismatch", [], "does not fit LlamaForCausalLM: {root}/mismatch/model.safetensors: model.layers.0.mlp"),
        ("llama", ["--set", "data.seq_len=128"], "data.seq_len=128 is longer than the model's context"),
        ("llama", ["--set", "parallel.pipeline.size=8"], "has only 4 layers to split (the entry (embeddings), 2 decoder"),
        ("llama", ["--data", "{root}/no_texts"], "data.files: {root}/no_texts does not exist"),
    ],
)  # fmt: skip
def test_a_model_or_data_that_cannot_train_fails_naming_the_rule(capsys, folders, case, extra, message):
    extra = [e.format(root=folders) for e in extra]
    err = train_error(capsys, "--model", f"hf:{folders / case}", *extra)
    assert message.format(root=folders) in err, err


def test_a_model_name_that_is_neither_gpt_nor_hf_fails_in_the_config_and_on_the_command_line(capsys, tmp_path):
    config = tmp_path / "bad.py"
    config.write_text("model = dict(name='llama')\n")
    err = train_error(capsys, str(config))
    assert "model.name='llama' is not a model tessera train builds; allowed: 'gpt'" in err and "'hf:PATH'" in err
    assert "names no path" in train_error(capsys, "--model", "hf:")
    assert "data.name='text_files' needs data.files" in train_error(capsys, "--set", "data.name=text_files")


def test_without_transformers_an_hf_model_asks_for_the_extra(capsys, folders, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    err = train_error(capsys, "--model", f"hf:{folders / 'llama'}")
    assert "needs transformers, which is not installed: pip install 'tessera[hf]'" in err


def test_adapters_fine_tuned_under_tensor_parallelism_load_into_peft(launched):
    import peft

    tmp_path, out = launched["adapters"]
    run_dir = tmp_path / "run"
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["adapter", "config.json", "loss.png", "metrics.jsonl"]
    trained = losses(run_dir)
    assert trained[-1] < trained[0] - 0.1, trained
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    text = torch.tensor(list((REPO / "tessera" / "train.py").read_bytes()[:2048]), dtype=torch.int64)[None]
    before = loss_on(base, text)
    adapted = peft.PeftModel.from_pretrained(base, run_dir / "adapter")
    assert adapted.peft_config["default"].r == 4
    assert loss_on(adapted, text) < before - 0.05


def test_lora_on_tessera_gpt_writes_its_weights_with_the_adapters_merged(launched):
    from tessera.checkpoint import load_weights
    from tessera.models import gpt

    tmp_path, out = launched["gpt-lora"]
    run_dir = tmp_path / "run"
    assert out.returncode == 0, out.stdout + out.stderr
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    weights = load_weights(run_dir / "model.safetensors")
    plain = gpt("tiny")
    assert set(weights) == set(plain.state_dict()), "the plain GPT's keys: no base_layer, lora_ or codes"
    plain.load_state_dict(weights)  # shapes fit
    config = tmp_path / "model.yaml"
    config.write_text(f"model:\n  name: gpt\n  preset: tiny\n  init: {run_dir / 'model.safetensors'}\n")
    done = run([sys.executable, "-m", "tessera.cli", "generate", str(config), "--nproc-per-node", "1",
                "--prompt", "def", "--max-tokens", "4"], timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
