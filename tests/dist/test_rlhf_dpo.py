"""DPO under data parallelism with ZeRO-2 (2 ranks, each its half of the pairs), and under 1D
tensor parallelism (vocabulary-parallel log-probs, policy and reference split), takes the same
steps as one process accumulating the same halves (fp32, ``tessera.testing.tolerance``): losses,
margins and weights. The accuracy (the pairs with a positive margin, which one rounding can flip)
is not compared; tests/unit/test_rlhf_dpo.py checks it."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import DPOOptions, DPOTrainer, PreferenceDataset, load_preferences, sorting_files
from tessera.testing import tolerance, use_layout, within

STEPS, PAIRS = 4, 8  # pairs per step, over all ranks


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)


def train(data: int, zero: int, tensor: int = 1) -> tuple | None:
    """STEPS DPO steps; each step's pairs cut into ``data`` halves: this rank's half, or (one
    process) every half as a micro-batch of its own."""
    config = {"parallel": {"data": data, "tensor": tensor}, "zero": {"stage": zero}, "gradient_accumulation": 2 // data}
    ctx = use_layout(data=data, tensor=tensor, config=config)
    policy = build()
    # eps 1e-6: the key bias has no gradient but rounding noise, which a smaller eps would blow up
    engine, _, _, _ = tessera.initialize(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3, eps=1e-6))
    trainer = DPOTrainer(engine, build(), DPOOptions(beta=0.1))
    pairs = PreferenceDataset(load_preferences(sorting_files().train)[: STEPS * PAIRS], ByteTokenizer())
    history = []
    for step in range(STEPS):
        halves = [list(range(step * PAIRS + h, (step + 1) * PAIRS, 2)) for h in range(2)]
        mine = [halves[ctx.local_rank("data")]] if data == 2 else halves
        history.append(trainer.train_step([pairs.collate([pairs[i] for i in rows]) for rows in mine]))
    state = full_state_dict(engine.model)
    return (history, state) if ctx.rank == 0 else None


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 0, 2)], ids=["zero2-dp2", "tp2"])
def test_dpo_takes_the_single_process_steps(pools, layout):
    expected_history, expected_state = train(1, 0)
    history, state = pools.run(2, train, *layout, timeout=600)[0]
    for got, want in zip(history, expected_history):
        assert got.keys() == want.keys()
        for key in want.keys() - {"accuracy"}:
            assert within(got[key], want[key], blocks=2, steps=STEPS), (key, got, want)
    assert expected_history[-1]["margin"] > 0
    for key in expected_state:
        torch.testing.assert_close(state[key], expected_state[key], **tolerance(blocks=2, steps=STEPS), msg=key)
