"""Served LoRA adapters: many PEFT adapters over one copy of a base, each sequence of a batched
step with its own (``tessera.lora.routing``, ``tessera.inference.adapters``).

The routed layer gives every token the output of the base with its own adapter merged in; the
engine, with two adapters of different ranks and targets and the plain base decoding in the
same steps, gives each prompt the greedy tokens of PEFT's ``merge_and_unload`` of its adapter
(a plain loop over the merged ``transformers`` model); over an int8 base, those of the adapter
merged into the dequantized base. Folders for another base, or with what tessera does not
serve, are refused naming why. The e2e test (tests/e2e/test_serve_adapters.py) runs the same
models behind ``tessera serve``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import tessera
from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.inference.engine import CacheOptions, InferenceEngine
from tessera.inference.models import prepare_model
from tessera.inference.params import SamplingParams
from tessera.lora.quant import dequantize_weight, quantize_weight
from tessera.lora.routing import AdapterRouting, RoutedLoraLinear
from tessera.testing import assert_draws_clear, greedy_draws

LLAMA = dict(
    vocab_size=256, hidden_size=32, intermediate_size=50, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=96, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
# two adapters of different ranks over different layers (column- and row-parallel ones under tp2)
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "beta": dict(r=2, lora_alpha=3, target_modules=["k_proj", "gate_proj", "down_proj"]),
}
PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [66, 67], [9], [40, 2, 200, 31, 77]]
NEW = 12


def base_model(**changes) -> nn.Module:
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**(LLAMA | changes))).eval()


def save_adapter(folder: Path, seed: int, base: nn.Module | None = None, **config) -> Path:
    """A PEFT adapter folder with random factors, B too (``init_lora_weights=False``)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base or base_model(), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(folder)
    return folder


def make_folders(root: Path) -> dict[str, Path]:
    """The base as a transformers folder and its two adapters as PEFT folders."""
    base_model().save_pretrained(root / "base")
    paths = {"base": root / "base"}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        paths[name] = save_adapter(root / name, 10 + seed, **config)
    return paths


def merged(paths: dict[str, Path], name: str | None) -> nn.Module:
    """The base with adapter ``name`` folded in by PEFT (None: the base)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
    return base if name is None else peft.PeftModel.from_pretrained(base, paths[name]).merge_and_unload().eval()


def greedy_loop(model: nn.Module, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """Greedy tokens without a cache (the whole sequence through the model per token), each
    choice checked to win by more than the logits' rounding could move."""
    outs, draws = [], []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(new):
                logits = model(torch.tensor([seq])).logits[0, -1]
                draws += greedy_draws(logits)
                seq.append(int(logits.argmax()))
            outs.append(seq[len(prompt) :])
    assert_draws_clear(draws, blocks=LLAMA["num_hidden_layers"])
    return outs


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return make_folders(tmp_path_factory.mktemp("lora-serving"))


def engine_over(paths: dict[str, Path], names: list[str], **options) -> InferenceEngine:
    ctx = ParallelContext.alone()
    model = tessera.hf.from_pretrained(paths["base"])
    runner = prepare_model(model, ctx, adapters=[paths[n] for n in names], **options)
    return InferenceEngine(runner, ctx, CacheOptions(num_blocks=64, block_size=8))


# ---- the routed layer ----------------------------------------------------------------------------
def test_each_sequence_gets_the_base_with_its_own_adapter_merged():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    routing = AdapterRouting(3)  # adapter 2 exists but targets other layers: no delta here
    layer = RoutedLoraLinear(base, routing)
    factors = {0: (torch.randn(4, 16), torch.randn(12, 4), 2.0), 1: (torch.randn(2, 16), torch.randn(12, 2), 0.5)}
    for index, (a, b, scaling) in factors.items():
        layer.add(index, a, b, scaling)
    x = torch.randn(6, 3, 16)

    def separately(ids: list[int]) -> torch.Tensor:
        rows = []
        for s, adapter in enumerate(ids):
            weight = base.weight.detach().clone()
            if adapter in factors:
                a, b, scaling = factors[adapter]
                weight += b @ a * scaling
            rows.append(F.linear(x[s], weight, base.bias))
        return torch.stack(rows)

    with torch.no_grad():
        for ids in ([0, -1, 1, 0, 2, 1], [1] * 6, [-1] * 6, [2, 0, 2, 2, 0, 2]):
            routing.route(ids, 3)
            torch.testing.assert_close(layer(x), separately(ids))
        routing.route([-1] * 6, 3)
        assert torch.equal(layer(x), base(x))  # no adapter: the base alone, bit for bit


def test_routing_refuses_what_does_not_fit():
    routing = AdapterRouting(2)
    with pytest.raises(ValueError, match="adapter 2 does not exist"):
        routing.route([0, 2], 1)
    layer = RoutedLoraLinear(nn.Linear(4, 4), routing)
    routing.route([0, 1], 3)
    with pytest.raises(RuntimeError, match="routing is for 6 tokens, the layer got 4"):
        layer(torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match="not \\[r, in\\] and \\[out, r\\]"):
        layer.add(0, torch.randn(2, 4), torch.randn(4, 3), 1.0)


# ---- the engine ----------------------------------------------------------------------------------
def test_two_adapters_and_the_base_decode_together_with_each_ones_merged_tokens(folders):
    expected = {name: greedy_loop(merged(folders, name), PROMPTS) for name in (None, *ADAPTERS)}
    engine = engine_over(folders, list(ADAPTERS))
    routing = engine.runner.routing
    mixed = []  # steps whose batch held more than one adapter (or an adapter and the base)
    route = routing.route

    def recording(per_sequence, width):
        route(per_sequence, width)
        if len(set(per_sequence)) > 1:
            mixed.append(tuple(per_sequence))

    routing.route = recording
    names = [None, "alpha", "beta", "alpha", "beta", None, "beta", "alpha"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    index = {None: -1, "alpha": 0, "beta": 1}
    results = engine.generate(
        prompts,
        SamplingParams(max_tokens=NEW, temperature=0.0),
        adapters=[index[n] for n in names],
        arrivals=[0, 0, 0, 2, 3, 3, 5, 9],
    )
    assert [r.tokens for r in results] == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert sum(set(ids) == {-1, 0, 1} for ids in mixed) > NEW  # the base and both adapters in one step
    assert expected["alpha"] != expected[None] != expected["beta"] != expected["alpha"]  # three answers
    assert engine.scheduler is not None and engine.scheduler.allocator.used == 0


def test_adapters_over_an_int8_base_give_the_adapter_merged_into_the_dequantized_base(folders):
    engine = engine_over(folders, ["alpha"], quantize="int8")
    results = engine.generate(PROMPTS[2:] * 2, SamplingParams(max_tokens=NEW, temperature=0.0), adapters=[0, 0, -1, -1])
    base = transformers.AutoModelForCausalLM.from_pretrained(folders["base"]).eval()
    with torch.no_grad():
        for module in base.modules():
            if isinstance(module, nn.Linear):  # what quantize_int8 quantizes in this model
                module.weight.copy_(dequantize_weight(*quantize_weight(module.weight, 0), 0))
    plain = greedy_loop(base, PROMPTS[2:])
    adapted = greedy_loop(peft.PeftModel.from_pretrained(base, folders["alpha"]).merge_and_unload().eval(), PROMPTS[2:])
    assert [r.tokens for r in results] == adapted + plain
    assert adapted != plain


def test_a_request_for_an_adapter_that_is_not_served_is_refused(folders):
    engine = engine_over(folders, ["alpha", "beta"])
    with pytest.raises(ValueError, match="adapter 2 does not exist: 2 adapters are served"):
        engine.add_request("r", [1, 2], SamplingParams(), adapter=2)


# ---- folders tessera refuses ---------------------------------------------------------------------
def test_a_folder_made_for_another_base_is_refused_naming_the_shapes(folders, tmp_path):
    other = save_adapter(tmp_path / "wide", 1, base=base_model(hidden_size=48), **ADAPTERS["alpha"])
    with pytest.raises(ConfigError, match=r"q_proj.lora_A.weight: \(4, 48\) in the folder, \(4, 32\) here"):
        engine_over(folders | {"wide": other}, ["alpha", "wide"])
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=256))
    foreign = save_adapter(tmp_path / "gpt2", 1, base=gpt2, r=2, target_modules=["c_attn"])
    with pytest.raises(ConfigError, match="c_attn.lora_A.weight: no such adapter here"):
        engine_over(folders | {"gpt2": foreign}, ["gpt2"])


@pytest.mark.parametrize(
    "change, named",
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"use_rslora": True}, "use_rslora"),
    ],
)
def test_what_tessera_does_not_serve_is_refused_before_loading(folders, tmp_path, change, named):
    from tessera.inference.adapters import read_servable

    folder = Path(shutil.copytree(folders["alpha"], tmp_path / "changed"))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | change))
    with pytest.raises(
        ConfigError, match=f"tessera serves plain LoRA adapters of linear layers; this folder has {named}"
    ):
        read_servable(folder)


def test_the_command_line_names_adapters_and_refuses_clashes(folders, tmp_path):
    from tessera.cli.serve import parse_adapters

    named = parse_adapters([f"sql={folders['alpha']}", str(folders["beta"])], "base")
    assert named == (("sql", str(folders["alpha"].resolve())), ("beta", str(folders["beta"].resolve())))
    with pytest.raises(ConfigError, match="'alpha' is given twice"):
        parse_adapters([str(folders["alpha"]), f"alpha={folders['beta']}"], "base")
    with pytest.raises(ConfigError, match="'base' is the base model's name"):
        parse_adapters([f"base={folders['alpha']}"], "base")
    with pytest.raises(ConfigError, match="is not a PEFT adapter folder"):
        parse_adapters([f"x={tmp_path}"], "base")
