"""``initialize`` refuses a tensor or pipeline axis that the model gives nothing to split (its
ranks would silently compute the same thing), and accepts the reference models in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessera
from tessera.engine.initialize import check_model_fits_layout
from tessera.errors import ConfigError
from tessera.models import NextTokenLoss, gpt, vit
from tessera.testing import use_layout


class PlainMLP(nn.Module):
    """A plain PyTorch model: no tessera.nn layer, no blocks to cut."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class NestedBlocksLM(nn.Module):
    """Laid out as Hugging Face's GPT-2 is (blocks at ``transformer.h``), with plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.lm_head = nn.Linear(8, 16)


def config(tensor: int = 1, mode: str = "1d", depth: int = 1, pipeline: int = 1) -> dict:
    return {"parallel": {"tensor": {"size": tensor, "mode": mode, "depth": depth}, "pipeline": {"size": pipeline}}}


def body_refusal(model_name: str, tensor: int, pipeline: int) -> str:
    """The ConfigError ``initialize`` raises for the model under the layout ('' if none)."""
    use_layout(tensor=tensor, pipeline=pipeline, config=config(tensor=tensor, pipeline=pipeline))
    torch.manual_seed(0)
    model = PlainMLP() if model_name == "PlainMLP" else NestedBlocksLM()
    try:
        tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("model_name", ["PlainMLP", "NestedBlocksLM"])
def test_tensor_ranks_without_tensor_layers_are_refused(pools, model_name):
    for message in pools.run(2, body_refusal, model_name, 2, 1):
        assert message.startswith(f"parallel.tensor.size=2: {model_name} has no layer split along the tensor axis")
        assert "tessera.nn" in message and "parallel.tensor.size=1" in message and "Hugging Face" in message


@pytest.mark.parametrize("model_name", ["PlainMLP", "NestedBlocksLM"])
def test_pipeline_stages_without_layers_to_cut_are_refused(pools, model_name):
    for message in pools.run(2, body_refusal, model_name, 1, 2):
        assert message.startswith(f"parallel.pipeline.size=2: tessera cannot find the layers of {model_name}")
        assert "pipeline_layers()" in message and "parallel.pipeline.size=1" in message


def body_reference_models_fit(layout: dict) -> list[str]:
    """Run the check on the GPT and the ViT built under ``layout``; names of those refused."""
    ctx = use_layout(**layout, config=config(**layout))
    refused = []
    for name, build in (("gpt", lambda: gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)),
                        ("vit", lambda: vit("tiny", img_size=12, patch_size=4, d_model=32, n_layers=2, n_heads=4))):  # fmt: skip
        try:
            check_model_fits_layout(build(), ctx)
        except ConfigError:
            refused.append(name)
    return refused


FITTING = {
    "1d-tp2": (2, dict(tensor=2)),
    "pp2": (2, dict(pipeline=2)),
    "2d-tp4": (4, dict(tensor=4, mode="2d")),
    "2.5d-tp4-d1": (4, dict(tensor=4, mode="2.5d")),
    "pp2-tp2": (4, dict(tensor=2, pipeline=2)),
    "3d-tp8": (8, dict(tensor=8, mode="3d")),
}


@pytest.mark.parametrize("name", list(FITTING))
def test_reference_models_fit_every_tensor_mode_and_the_pipeline(pools, name):
    ranks, layout = FITTING[name]
    assert pools.run(ranks, body_reference_models_fit, layout) == [[]] * ranks


def body_gpt_trains_under_tp2() -> float:
    use_layout(tensor=2, config=config(tensor=2))
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NextTokenLoss())
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    return engine.train_batch(iter([(tokens[:, :-1], tokens[:, 1:])]))


def test_a_tessera_model_still_initializes_and_trains_under_tp2(pools):
    losses = pools.run(2, body_gpt_trains_under_tp2)
    assert losses[0] == losses[1] and losses[0] > 0
