"""DPO with LoRA adapters whose reference is the policy's own base with the adapters off
(``tessera.rlhf.adapters_off``) takes the steps of DPO against a separate frozen copy of the base
(ZeRO-2 over two ranks), and holds one copy of the base instead of two: its peak RSS per rank is
lower by the base's bytes."""

from __future__ import annotations

import torch

import tessera
import tessera.lora
from tessera.inference.text import ByteTokenizer
from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap
from tessera.models import gpt
from tessera.rlhf import DPOOptions, DPOTrainer, PreferenceDataset, adapters_off, load_preferences, sorting_files
from tessera.testing import tolerance, use_layout

STEPS, PAIRS = 4, 4  # pairs per step per rank
SMALL = dict(vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)
# about 25M parameters (101 MB in fp32): the base a second copy would add
LARGE = dict(vocab_size=256, max_seq_len=32, d_model=576, n_layers=6, n_heads=8, d_ff=2304, dropout=0.0)


def build(sizes: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", **sizes)


def dpo(own_base: bool, sizes: dict, steps: int = STEPS) -> tuple[list[dict], int, int]:
    """DPO steps of a LoRA policy under ZeRO-2 dp2 against its base with the adapters off
    (``own_base``) or a separate frozen copy; the history, and this rank's RSS before the models
    were built and at its peak after."""
    ctx = use_layout(data=2, config={"parallel": {"data": 2}, "zero": {"stage": 2}})
    pairs = PreferenceDataset(load_preferences(sorting_files().train)[: steps * PAIRS * 2], ByteTokenizer())
    trim_heap()
    assert reset_peak_rss(), "the peak RSS could not be reset (/proc/self/clear_refs)"
    before = peak_rss_bytes()
    policy = tessera.lora.apply(build(sizes), rank=4, alpha=16.0, init="gaussian")
    with torch.no_grad():  # B non-zero: the policy differs from its base from the first step
        for _, layer in tessera.lora.adapters(policy):
            layer.lora_B.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
    trained = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = tessera.initialize(policy, torch.optim.AdamW(trained, lr=1e-3, eps=1e-6))
    reference = adapters_off(engine) if own_base else build(sizes)
    trainer = DPOTrainer(engine, reference, DPOOptions(beta=0.1))
    rank = ctx.local_rank("data")
    history = []
    for step in range(steps):
        rows = range((step * 2 + rank) * PAIRS, (step * 2 + rank + 1) * PAIRS)
        history.append(trainer.train_step([pairs.collate([pairs[i] for i in rows])]))
    peak = peak_rss_bytes()
    assert before is not None and peak is not None
    return history, before, peak


def test_dpo_against_the_adapters_off_base_takes_the_steps_of_a_separate_reference(pools):
    separate = pools.run(2, dpo, False, SMALL, timeout=300)
    own = pools.run(2, dpo, True, SMALL, timeout=300)
    for (want, _, _), (got, _, _) in zip(separate, own, strict=True):
        for a, b in zip(got, want, strict=True):
            for key in b.keys() - {"accuracy"}:
                torch.testing.assert_close(
                    torch.tensor(a[key]), torch.tensor(b[key]), **tolerance(blocks=2, steps=STEPS), msg=key
                )


def test_the_adapters_off_reference_saves_a_copy_of_the_base(pools):
    base_bytes = sum(p.numel() * p.element_size() for p in build(LARGE).parameters())
    grown = {}
    for own_base in (False, True):
        runs = pools.run(2, dpo, own_base, LARGE, 2, timeout=600)
        grown[own_base] = max(peak - before for _, before, peak in runs)
    saved = grown[False] - grown[True]
    print(
        f"peak RSS growth per rank: separate reference {grown[False] / 2**20:.0f} MiB, adapters off "
        f"{grown[True] / 2**20:.0f} MiB; saved {saved / 2**20:.0f} MiB, the base {base_bytes / 2**20:.0f} MiB"
    )
    assert saved >= base_bytes, (saved / 2**20, base_bytes / 2**20, grown)
