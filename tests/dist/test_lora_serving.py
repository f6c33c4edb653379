"""Served LoRA adapters under 1D tensor parallelism and pipeline stages: two adapters of
different ranks and targets and the plain base, decoding in the same steps, give each prompt the
greedy tokens of PEFT's ``merge_and_unload`` of its adapter.

LLaMA (q/k/v/gate column-parallel, o/down row-parallel: an adapter's ``B`` split with a column
base, its ``A`` with a row base, the row delta summed by the base's own all-reduce) under tp2
and pp2, and over an int8 base under tp2 (the reference: the adapter merged into the base
dequantized as each rank quantized its block); GPT-2 (the fused q/k/v ``Conv1D``, each part's
``B`` split on its own) under tp2.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import transformers
from torch import nn

import tessera
from tessera.testing import use_layout
from tests.unit.test_lora_serving import ADAPTERS, PROMPTS, greedy_loop, make_folders, merged, save_adapter

GPT2 = dict(vocab_size=256, n_positions=96, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
GPT2_ADAPTERS = {  # c_proj: the attention's and the MLP's output projections (row-parallel)
    "alpha": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True),
    "beta": dict(r=2, lora_alpha=3, target_modules=["c_fc"], fan_in_fan_out=True),
}
NAMES = [None, "alpha", "beta", "alpha", None, "beta"]
ARRIVALS = [0, 0, 0, 2, 3, 5]
CASES = {"llama-tp2": ("llama", 1, 2, None), "llama-pp2": ("llama", 2, 1, None),
         "llama-tp2-int8": ("llama", 1, 2, "int8"), "gpt2-tp2": ("gpt2", 1, 2, None)}  # fmt: skip


def prompts() -> list[list[int]]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(len(NAMES))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-serving-dist")
    paths = {"llama": make_folders(root / "llama")}
    torch.manual_seed(3)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    gpt2.save_pretrained(root / "gpt2" / "base")
    paths["gpt2"] = {"base": root / "gpt2" / "base"}
    for seed, (name, config) in enumerate(GPT2_ADAPTERS.items()):
        torch.manual_seed(3)
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
        paths["gpt2"][name] = save_adapter(root / "gpt2" / name, 20 + seed, base=base, **config)
    return paths


def int8_by_block(model: nn.Module, tensor: int) -> nn.Module:
    """``model`` with each linear weight dequantized as ``tensor`` ranks quantize their blocks
    (per output channel; a row-parallel weight's scales per block of its inputs)."""
    from tessera.lora.quant import dequantize_weight, quantize_weight

    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            blocks = module.weight.chunk(tensor, dim=1) if name.endswith(("o_proj", "down_proj")) else [module.weight]
            module.weight.copy_(torch.cat([dequantize_weight(*quantize_weight(b, 0), 0) for b in blocks], dim=1))
    return model


def expected_tokens(paths: dict[str, Path], quantize: str | None, tensor: int) -> list[list[int]]:
    answers = {}
    for name in (None, "alpha", "beta"):
        if quantize is None:
            model = merged(paths, name)
        else:
            base = int8_by_block(transformers.AutoModelForCausalLM.from_pretrained(paths["base"]).eval(), tensor)
            model = base if name is None else peft.PeftModel.from_pretrained(base, paths[name]).merge_and_unload()
        answers[name] = greedy_loop(model.eval(), PROMPTS)
    assert answers["alpha"] != answers[None] != answers["beta"] != answers["alpha"]
    return [answers[name][i % len(PROMPTS)] for i, name in enumerate(NAMES)]


def served(pipeline: int, tensor: int, paths: dict[str, Path], quantize: str | None) -> list[list[int]]:
    from tessera.inference.engine import CacheOptions, InferenceEngine
    from tessera.inference.models import prepare_model
    from tessera.inference.params import SamplingParams

    ctx = use_layout(pipeline=pipeline, tensor=tensor, data=1)
    model = tessera.hf.from_pretrained(paths["base"])
    runner = prepare_model(model, ctx, quantize=quantize, adapters=[paths["alpha"], paths["beta"]])
    engine = InferenceEngine(runner, ctx, CacheOptions(num_blocks=64, block_size=8))
    index = {None: -1, "alpha": 0, "beta": 1}
    results = engine.generate(
        prompts(),
        SamplingParams(max_tokens=12, temperature=0.0),
        adapters=[index[n] for n in NAMES],
        arrivals=ARRIVALS,
    )
    return [r.tokens for r in results]


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_decoding_together_give_each_ones_merged_tokens(pools, folders, case):
    family, pipeline, tensor, quantize = CASES[case]
    expected = expected_tokens(folders[family], quantize, tensor)
    for tokens in pools.run(pipeline * tensor, served, pipeline, tensor, folders[family], quantize):
        assert tokens == expected
