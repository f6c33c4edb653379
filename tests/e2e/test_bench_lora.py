"""``tessera bench lora`` on a tiny LLaMA: every side trains (the same first loss: the LoRA sides
start as their base, B at zero), the rows are made, and the largest-model search ends."""

from __future__ import annotations

from tessera.bench import lora
from tessera.bench.zero_sides import deepspeed_available

TINY = lora.Workload(vocab=256, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, seq=16, batch=2, rank=4)


def test_bench_lora_rows(pools):
    report: dict = {}
    ds = deepspeed_available()  # CI does not install the bench extra: then its rows are absent
    rows = lora.run(TINY, blocks=2, steps=1, memory_steps=1, budget_mib=64, most=2, report=report, pools=pools)
    anchors = {(row.name.split(" vs ")[0], row.anchor) for row in rows if row.metric == "step_time_s"}
    expected = {(lora.LORA, lora.FULL), (lora.INT8, lora.FULL), (lora.NF4, lora.FULL), (lora.LORA, lora.PEFT_DDP)}
    expected |= {(lora.LORA, lora.PEFT_DS), (lora.NF4, lora.PEFT_DS)} if ds else set()
    assert anchors == expected, report["errors"]
    first = {label: values[0] for label, values in report["losses"].items()}
    full = first.pop(lora.FULL)
    for label in (lora.LORA, lora.PEFT_DDP, *([lora.PEFT_DS] if ds else [])):
        assert abs(first[label] - full) < 1e-4 * full, (label, first)  # B = 0: the base's own loss
    trainable = {row.name.split(" vs ")[0]: row.value for row in rows if row.metric == "trainable_params"}
    peft_trainable = next(
        row.anchor_value for row in rows if row.metric == "trainable_params" and row.anchor == lora.PEFT_DDP
    )
    assert trainable[lora.LORA] == peft_trainable  # the same adapters
    assert any(row.metric == "parameters" for row in rows) or report["tried"]
