"""Served LoRA adapters on the device: the inference engine on the GPU, two adapters and the
plain base decoding in the same steps, gives each prompt the greedy tokens of its adapter merged
into the base by PEFT (computed on CPU, each choice clear of rounding)."""

from __future__ import annotations

import pytest

import tessera
from tessera.context import ParallelContext
from tessera.inference.engine import CacheOptions, InferenceEngine
from tessera.inference.models import prepare_model
from tessera.inference.params import SamplingParams
from tests.unit.test_lora_serving import ADAPTERS, NEW, PROMPTS, greedy_loop, make_folders, merged


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_folders(tmp_path_factory.mktemp("lora-serving-lane"))


def test_adapters_decode_together_on_the_device_with_each_ones_merged_tokens(device, folders):
    expected = {name: greedy_loop(merged(folders, name), PROMPTS) for name in (None, *ADAPTERS)}
    ctx = ParallelContext.alone(device)
    runner = prepare_model(tessera.hf.from_pretrained(folders["base"]), ctx, adapters=[folders[n] for n in ADAPTERS])
    engine = InferenceEngine(runner, ctx, CacheOptions(num_blocks=64, block_size=8))
    assert all(p.device == device for p in runner.model.parameters() if not p.is_meta)  # type: ignore[attr-defined]
    names = [None, "alpha", "beta", "alpha", "beta", None]
    index = {None: -1, "alpha": 0, "beta": 1}
    results = engine.generate(
        [PROMPTS[i % len(PROMPTS)] for i in range(len(names))],
        SamplingParams(max_tokens=NEW, temperature=0.0),
        adapters=[index[n] for n in names],
    )
    assert [r.tokens for r in results] == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]
