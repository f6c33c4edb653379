"""DPOTrainer: its loss equals DPO's formula written out with log-softmax on the same batch, a
reference-free run needs no reference, and on the sorting task one epoch of a tiny GPT raises
the chosen-over-rejected margin of held-out pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import tessera
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import PreferenceDataset, PreferenceExample, load_preferences, sorting_files
from tessera.rlhf.dpo import DPOOptions, DPOTrainer
from tessera.testing import use_layout, within

BYTES = ByteTokenizer()


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0)


def engine_of(model: torch.nn.Module, lr: float = 1e-3):
    use_layout(config={})
    engine, _, _, _ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr))
    return engine


def by_hand(policy, reference, pairs: list[PreferenceExample], beta: float) -> float:
    """DPO's loss from its definition: each response's log-likelihood after its prompt."""

    def loglik(model, prompt: str, response: str) -> float:
        ids = torch.tensor([BYTES.encode(prompt + response)])
        with torch.no_grad():
            logp = F.log_softmax(model(ids)[0, :-1].double(), dim=-1)
        start = len(BYTES.encode(prompt))
        return sum(float(logp[t - 1, ids[0, t]]) for t in range(start, ids.shape[1]))

    total = 0.0
    for p in pairs:
        h = (loglik(policy, p.prompt, p.chosen) - loglik(reference, p.prompt, p.chosen)) - (
            loglik(policy, p.prompt, p.rejected) - loglik(reference, p.prompt, p.rejected)
        )
        total += -float(F.logsigmoid(torch.tensor(beta * h, dtype=torch.float64)))
    return total / len(pairs)


def test_the_loss_is_dpos_formula_on_the_same_pairs():
    policy, reference = build(), build()
    with torch.no_grad():  # a policy apart from its reference, so the margin is not 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pairs = [PreferenceExample("sort 3 1:", " 1 3\n", " 3 1\n"), PreferenceExample("sort 2 0 4:", " 0 2 4\n", " 0 4\n")]
    data = PreferenceDataset(pairs, BYTES)
    batch = data.collate([data[0], data[1]])
    expected = by_hand(policy, reference, pairs, beta=0.5)
    trainer = DPOTrainer(engine_of(policy), reference, DPOOptions(beta=0.5))
    with torch.no_grad():
        loss, stats = trainer.losses(trainer.policy(batch["input_ids"]), batch)
    assert within(loss.item(), expected, blocks=2), (loss.item(), expected)  # by hand: a forward per sequence
    assert abs(expected - 0.6931) > 1e-3
    assert float(stats["accuracy"]) in (0.0, 0.5, 1.0)


def test_a_reference_is_required_unless_reference_free():
    engine = engine_of(build())
    with pytest.raises(ValueError, match="reference_free=True"):
        DPOTrainer(engine, None)
    with pytest.raises(ValueError, match="loss_type"):
        DPOOptions(loss_type="kto")
    trainer = DPOTrainer(engine, None, DPOOptions(reference_free=True))
    data = PreferenceDataset([PreferenceExample("sort 1 0:", " 0 1\n", " 1 0\n")], BYTES)
    metrics = trainer.train_step([data.collate([data[0]])])
    assert metrics["loss"] > 0 and set(metrics) == {"loss", "chosen_reward", "rejected_reward", "margin", "accuracy"}


def test_one_epoch_raises_the_held_out_margin_on_the_sorting_task():
    files = sorting_files()
    train = PreferenceDataset(load_preferences(files.train), BYTES)
    held = PreferenceDataset(load_preferences(files.heldout), BYTES)
    trainer = DPOTrainer(engine_of(build()), build(), DPOOptions(beta=0.1))
    held_out = DataLoader(held, batch_size=50, collate_fn=held.collate)
    before = trainer.evaluate(held_out)
    loader = DataLoader(train, batch_size=16, shuffle=True, collate_fn=train.collate,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    for batch in loader:
        trainer.train_step([batch])
    after = trainer.evaluate(held_out)
    assert before["margin"] == 0.0 and before["loss"] == pytest.approx(0.6931, abs=1e-4)  # the policy is the reference
    assert after["margin"] > 0.5 and after["accuracy"] > 0.75 and after["loss"] < 0.5
