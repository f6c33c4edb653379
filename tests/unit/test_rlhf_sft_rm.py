"""SFTTrainer and RewardTrainer: their losses equal the formulas written out on the same batch,
the SFT loss counts response tokens only, a score is the value at a row's last real token, and on
the sorting task a few steps of a tiny GPT lower the held-out SFT loss and rank held-out pairs
above chance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import tessera
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import (
    PreferenceDataset,
    PreferenceExample,
    SFTDataset,
    SFTExample,
    load_preferences,
    sft_from_preferences,
    sft_loss,
    sorting_files,
    value_model,
)
from tessera.rlhf.reward import RewardOptions, RewardTrainer, reward_scores
from tessera.rlhf.sft import SFTTrainer
from tessera.testing import tolerance, use_layout, within

BYTES = ByteTokenizer()
EXAMPLES = [SFTExample("sort 3 1:", " 1 3\n"), SFTExample("sort 2 0 4 1:", " 0 1 2 4\n")]
PAIRS = [PreferenceExample("sort 3 1:", " 1 3\n", " 3 1\n"), PreferenceExample("sort 2 0 4:", " 0 2 4\n", " 0 4\n")]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)


def engine_of(model: torch.nn.Module, lr: float = 1e-3):
    use_layout(config={})
    engine, _, _, _ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr))
    return engine


def sft_batch():
    data = SFTDataset(EXAMPLES, BYTES)
    return data.collate([data[0], data[1]])


def test_the_sft_loss_is_the_mean_cross_entropy_of_the_response_tokens():
    model = build()

    def by_hand() -> float:
        """Each response token's -log p after its prompt and the tokens before it, in float64."""
        total, count = 0.0, 0
        for example in EXAMPLES:
            ids = torch.tensor([BYTES.encode(example.prompt + example.response)])
            with torch.no_grad():
                logp = F.log_softmax(model(ids)[0, :-1].double(), dim=-1)
            for t in range(len(BYTES.encode(example.prompt)), ids.shape[1]):
                total -= float(logp[t - 1, ids[0, t]])
                count += 1
        return total / count

    trainer = SFTTrainer(engine_of(model))
    batch = sft_batch()
    with torch.no_grad():
        logits = trainer.engine(batch["input_ids"])
        loss, stats = trainer.losses(logits, batch)
    expected = by_hand()
    assert within(loss.item(), expected, blocks=2), (loss.item(), expected)  # by hand: a forward per example
    assert stats["tokens"].item() == sum(len(e.response) for e in EXAMPLES) == 14
    assert loss.item() == pytest.approx(sft_loss(logits, batch["labels"], batch["loss_mask"]).item(), rel=1e-6)


def test_the_sft_loss_masks_prompts_and_padding():
    trainer = SFTTrainer(engine_of(build()))
    batch = sft_batch()
    with torch.no_grad():
        logits = trainer.engine(batch["input_ids"])
    loss, _ = trainer.losses(logits, batch)
    mask = batch["loss_mask"]
    prompt = (0, 0)  # row 0's first label is its prompt's second byte
    padding = (0, batch["input_ids"].shape[1] - 1)  # row 0 is the shorter one
    assert not mask[prompt] and not mask[padding] and mask[0].any() and mask[1, -1]
    for row, position in (prompt, padding):
        changed = logits.clone()
        changed[row, position, batch["labels"][row, position]] += 10.0  # the label made far likelier
        assert trainer.losses(changed, batch)[0].item() == loss.item()
    changed = logits.clone()
    changed[1, -1, batch["labels"][1, -1]] += 10.0  # a response token's: the loss falls
    assert trainer.losses(changed, batch)[0].item() < loss.item()
    # and no gradient reaches a masked position
    logits.requires_grad_(True)
    trainer.losses(logits, batch)[0].backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[~mask] == 0) and torch.all(logits.grad[mask].abs().sum(-1) > 0)


def pair_batch():
    data = PreferenceDataset(PAIRS, BYTES)
    return data.collate([data[0], data[1]])


def test_a_score_is_the_value_at_the_last_real_token():
    model = value_model(build())
    batch = pair_batch()
    assert len(set(batch["last_index"].tolist())) > 1  # rows of several lengths, so some are padded
    expected = []
    for row, last in enumerate(batch["last_index"].tolist()):
        alone = batch["input_ids"][row : row + 1, : last + 1]  # the row without its padding
        with torch.no_grad():
            expected.append(model(alone)[0, -1])
    model.train()
    scores = reward_scores(model, batch)
    torch.testing.assert_close(scores, torch.stack(expected), **tolerance(blocks=2))  # another batch shape
    assert model.training and not scores.requires_grad  # train mode put back; no graph kept
    trainer = RewardTrainer(engine_of(value_model(build())))
    torch.testing.assert_close(trainer.score(batch), scores)
    assert trainer.engine.module.training


def test_the_reward_loss_is_bradley_terry_on_the_last_token_scores():
    batch = pair_batch()
    values = torch.full(batch["input_ids"].shape, 100.0)  # every position but the last real ones
    chosen, rejected = torch.tensor([0.5, -1.0]), torch.tensor([0.2, 1.0])
    rows = torch.arange(4)
    values[rows, batch["last_index"]] = torch.cat([chosen, rejected])
    trainer = RewardTrainer(engine_of(value_model(build())))
    loss, stats = trainer.losses(values, batch)
    expected = -(F.logsigmoid(chosen - rejected)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["accuracy"].item() == 0.5 and stats["margin"].item() == pytest.approx(-0.85)
    assert stats["chosen_reward"].item() == pytest.approx(-0.25)
    assert stats["rejected_reward"].item() == pytest.approx(0.6)
    centred = RewardTrainer(trainer.engine, RewardOptions(center_rewards_coefficient=0.1))
    loss, _ = centred.losses(values, batch)
    assert loss.item() == pytest.approx((expected + 0.1 * (chosen + rejected).square().mean()).item(), rel=1e-6)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="value model"):
        RewardTrainer(engine_of(build()))
    with pytest.raises(TypeError, match="value model"):
        reward_scores(build(), pair_batch())
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardOptions(center_rewards_coefficient=-1.0)


def test_a_few_steps_learn_the_sorting_task():
    files = sorting_files()
    train, held = load_preferences(files.train), load_preferences(files.heldout)
    loader = {"batch_size": 16, "shuffle": True, "generator": torch.Generator().manual_seed(0)}

    sft_train, sft_held = SFTDataset(sft_from_preferences(train), BYTES), SFTDataset(sft_from_preferences(held), BYTES)
    sft = SFTTrainer(engine_of(build(), lr=3e-3))
    held_out = [sft_held.collate(sft_held.items)]
    before = sft.evaluate(held_out)
    for _, batch in zip(range(20), DataLoader(sft_train, collate_fn=sft_train.collate, **loader)):
        sft.train_step([batch])
    after = sft.evaluate(held_out)
    assert before["loss"] > 5.0 and after["loss"] < 3.0  # from about ln 256 = 5.5

    rm_train, rm_held = PreferenceDataset(train, BYTES), PreferenceDataset(held, BYTES)
    rm = RewardTrainer(engine_of(value_model(build()), lr=3e-3))
    held_out = [rm_held.collate(rm_held.items)]
    before = rm.evaluate(held_out)
    for _, batch in zip(range(20), DataLoader(rm_train, collate_fn=rm_train.collate, **loader)):
        rm.train_step([batch])
    after = rm.evaluate(held_out)
    assert before["accuracy"] < 0.55 and after["accuracy"] > 0.7 and after["margin"] > before["margin"] + 1.0
