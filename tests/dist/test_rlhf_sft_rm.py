"""SFT and the reward model under data parallelism with ZeRO-2 (2 ranks, each its half of the
examples) and under 1D tensor parallelism (SFT on vocabulary-parallel log-probs; the reward
model's backbone split, its head replicated) take the same steps as one process accumulating
the same halves (fp32, ``tessera.testing.tolerance``): losses, statistics and weights. The reward
model's accuracy (the pairs ranked right, which one rounding can flip) is not compared;
tests/unit/test_rlhf_sft_rm.py checks it."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.context.placement import placement_of
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import PreferenceDataset, SFTDataset, load_preferences, sft_from_preferences, sorting_files
from tessera.rlhf.models import value_model
from tessera.rlhf.reward import RewardOptions, RewardTrainer
from tessera.rlhf.sft import SFTTrainer
from tessera.testing import tolerance, use_layout, within

STEPS, ROWS = 3, 8  # examples (SFT) or pairs (reward model) per step, over all ranks


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)


def trainer_and_data(kind: str, engine_of):
    examples = load_preferences(sorting_files().train)[: STEPS * ROWS]
    if kind == "sft":
        return SFTTrainer(engine_of(build())), SFTDataset(sft_from_preferences(examples), ByteTokenizer())
    # the pairwise loss leaves the scores' offset free: the head's bias (and the final LayerNorm's)
    # gets a gradient of rounding noise alone, which AdamW turns into lr-sized steps that differ
    # between layouts; the centring term gives the offset a gradient of its own
    options = RewardOptions(center_rewards_coefficient=0.01)
    return RewardTrainer(engine_of(value_model(build())), options), PreferenceDataset(examples, ByteTokenizer())


def train(kind: str, data: int, zero: int, tensor: int = 1) -> tuple | None:
    """STEPS steps of ``kind`` ("sft" or "reward"); each step's rows cut into 2 halves: this
    rank's half (``data=2``), or (one process) every half as a micro-batch of its own."""
    config = {"parallel": {"data": data, "tensor": tensor}, "zero": {"stage": zero}, "gradient_accumulation": 2 // data}
    ctx = use_layout(data=data, tensor=tensor, config=config)

    def engine_of(model: torch.nn.Module):
        # eps 1e-5: the key bias has no gradient but rounding noise, and some elements of other
        # parameters start with gradients near 1e-7; a smaller eps lifts their rounding to lr's size
        return tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))[0]

    trainer, rows = trainer_and_data(kind, engine_of)
    history = []
    for step in range(STEPS):
        halves = [list(range(step * ROWS + h, (step + 1) * ROWS, 2)) for h in range(2)]
        mine = [halves[ctx.local_rank("data")]] if data == 2 else halves
        history.append(trainer.train_step([rows.collate([rows[i] for i in part]) for part in mine]))
    state = full_state_dict(trainer.engine.model)
    split = any(placement_of(p).shard is not None for p in trainer.engine.module.parameters())
    return (history, state, split) if ctx.rank == 0 else None


@pytest.mark.parametrize("kind", ["sft", "reward"])
@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 0, 2)], ids=["zero2-dp2", "tp2"])
def test_sft_and_the_reward_model_take_the_single_process_steps(pools, kind, layout):
    expected_history, expected_state, _ = train(kind, 1, 0)
    history, state, split = pools.run(2, train, kind, *layout, timeout=300)[0]
    assert split == (layout[2] == 2)  # tp2 splits the backbone (and the SFT GPT's head: vocabulary-parallel logits)
    for got, want in zip(history, expected_history, strict=True):
        assert got.keys() == want.keys()
        for key in want.keys() - {"accuracy"}:
            assert within(got[key], want[key], blocks=2, steps=STEPS), (key, got, want)
    assert expected_history[-1]["loss"] < expected_history[0]["loss"]
    for key in expected_state:
        torch.testing.assert_close(state[key], expected_state[key], **tolerance(blocks=2, steps=STEPS), msg=key)
