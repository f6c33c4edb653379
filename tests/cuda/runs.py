"""Short training runs that the lane repeats on different devices and layouts."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout

BATCH = 8
SEQ = 16
VOCAB = 64
STEPS = 10
BUCKET_MB = 0.016  # ~4k fp32 elements a chunk: the tiny GPT spreads over several chunks


def tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)


def token_data(steps: int = STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH * steps, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def gpt_config(dtype: str = "fp32", *, stage: int = 0, offload: str = "none") -> dict:
    return {
        "mixed_precision": {"dtype": dtype},
        "zero": {"stage": stage, "chunk_mb": BUCKET_MB, "offload_optimizer": offload},
    }


def train_gpt(device: torch.device, config: dict, steps: int = STEPS):
    """``steps`` AdamW steps of the tiny GPT through the engine on ``device`` (one process).

    Returns ``(losses, full state dict on CPU, engine)``.
    """
    use_layout(config=config, device=device)
    model = tiny_gpt()
    # eps above rounding noise: attention's key bias has an exactly-zero gradient (see test_tp_models)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(token_data(steps), batch_size=BATCH)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(steps)]
    state = {k: v.detach().to("cpu", copy=True) for k, v in full_state_dict(engine.model).items()}
    return losses, state, engine


def assert_same_run(got, expected, *, rtol: float, atol: float) -> None:
    """Losses within ``rtol`` and every tensor of the full state within ``rtol``/``atol``."""
    losses, state = got[0], got[1]
    ref_losses, ref_state = expected[0], expected[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key].float(), ref_state[key].float(), rtol=rtol, atol=atol, msg=key)
