"""Unmodified transformers models (GPT-2 with its tied head and fused q/k/v; LLaMA with
grouped-query attention and RMSNorm) under the grid tensor modes by their tessera.hf policies:
2D on 4 ranks, 2.5D on 8 (depth 2), 3D on 8. 10 AdamW steps give the losses and the weights of
plain single-process transformers (fp32, 1e-5), compared through the Hugging Face state-dict
keys; the batch (6 rows) does not divide the grids' batch blocks, so padding rows are tested.
Under bf16 (autocast, fp32 masters) LLaMA's losses stay within 2e-2 of fp32 transformers' in
each mode."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.testing import use_layout
from tests.dist.test_hf_tensor import batches, build, loss_of, optimizer_of, reference

LAYOUTS = {  # tensor size, mode, depth
    "2d-tp4": (4, "2d", 1),
    "2.5d-tp8-depth2": (8, "2.5d", 2),
    "3d-tp8": (8, "3d", 1),
}
ROWS = 6  # of the reference's 8: 6 does not divide 4 (2.5D's batch blocks) and leaves 3D's q=2 even


def train(family: str, tensor: int, mode: str, depth: int, dtype: str = "fp32"):
    config = {
        "parallel": {"tensor": {"size": tensor, "mode": mode, "depth": depth}},
        "mixed_precision": {"dtype": dtype},
    }
    use_layout(tensor=tensor, mode=mode, depth=depth, config=config)
    model = build(family)
    keys = list(model.state_dict())
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    losses = [float(engine.train_batch(iter([(x[:ROWS], y[:ROWS])]))) for x, y in batches()]
    state = full_state_dict(engine.model)
    kinds = sorted({type(m).__name__ for m in engine.model.modules() if type(m).__module__ == "tessera.hf.grid"})
    return losses, state, keys, kinds


def reference_rows(family: str):
    return reference(family, rows=ROWS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_transformers_model_trains_as_in_one_process_in_each_grid_mode(pools, family, layout):
    tensor, mode, depth = LAYOUTS[layout]
    expected_losses, expected = reference_rows(family)
    norm = "GridNorm" if family == "gpt2" else "GridRMSNorm"
    for losses, state, keys, kinds in pools.run(tensor, train, family, tensor, mode, depth, timeout=300):
        assert {"GridLinear", "GridEmbedding", "GridHead", norm} <= set(kinds)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: key + m)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_under_bf16_llama_tracks_fp32_transformers_in_each_grid_mode(pools, layout):
    tensor, mode, depth = LAYOUTS[layout]
    expected_losses, _ = reference_rows("llama")
    for losses, *_ in pools.run(tensor, train, "llama", tensor, mode, depth, "bf16", timeout=300):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses, strict=True)]
        assert 1e-5 < max(rel) < 2e-2, rel  # bf16 did run, and stays close
