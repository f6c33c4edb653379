"""The planner's memory model against measurement: the activation bytes per block and token of
every tensor and sequence mode equal what the saved-tensor hooks count, and the predicted peak
memory per rank is within 10% of the measured peak RSS growth (VmHWM above the baseline) and
the ledger's model-state bytes, for a subset of the layouts of ``tessera bench plan``."""

from __future__ import annotations

import pytest
import torch

from tessera.planner import Layout, Workload, from_gpt_preset
from tessera.planner.memory import block_activation_elements, head_activation_elements, predict_memory

BATCH, SEQ = 4, 64


def saved_per_block(layout_fields: dict, batch: int, seq: int) -> tuple[int, int]:
    """Bytes one forward keeps for the backward: (per block, outside the blocks), from a GPT of
    one block and one of two, under ``layout``."""
    import tessera
    from tessera.bench.plan import use_planned_layout
    from tessera.models import NextTokenLoss, gpt
    from tessera.nn.recompute import kept_for_backward

    use_planned_layout(Layout(**layout_fields))
    saved = {}
    for n in (1, 2):
        torch.manual_seed(0)
        model = gpt("small", max_seq_len=seq, n_layers=n)
        engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NextTokenLoss())
        tokens = torch.randint(0, 256, (batch, seq + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]  # the engine and its criterion take this rank's tokens

        def loss(engine=engine, x=x, y=y):
            return engine.criterion(engine(x), y)

        saved[n] = kept_for_backward(loss, engine.model.parameters())
    return saved[2] - saved[1], 2 * saved[1] - saved[2]


ACTIVATION_LAYOUTS = {
    "single": Layout(),
    "1d-tp2": Layout(tensor=2),
    "1d-tp4-sp": Layout(tensor=4, sequence_parallel=True),
    "2d-tp4": Layout(tensor=4, tensor_mode="2d"),
    "2.5d-tp8-d2": Layout(tensor=8, tensor_mode="2.5d", depth=2),
    "3d-tp8": Layout(tensor=8, tensor_mode="3d"),
    "ring-sp2": Layout(sequence=2),
    "ring_qk-sp2": Layout(sequence=2, sequence_mode="ring_qk"),
    "selective": Layout(checkpoint="selective"),
    "full": Layout(checkpoint="full"),
}


@pytest.mark.parametrize("name", list(ACTIVATION_LAYOUTS))
def test_activation_bytes_per_block_and_token_match_the_saved_tensors(pools, name):
    import dataclasses

    layout = ACTIVATION_LAYOUTS[name]
    model = from_gpt_preset("small", seq_len=SEQ)
    per_block, outside = pools.run(max(layout.world, 1), saved_per_block, dataclasses.asdict(layout), BATCH, SEQ)[0]
    tokens = BATCH * SEQ
    predicted_block = block_activation_elements(model, layout, SEQ) * tokens * 4
    assert per_block == pytest.approx(predicted_block, rel=0.03), (per_block, predicted_block)
    if layout.checkpoint == "none":  # the head's share: norm, output layer, loss
        predicted_head = head_activation_elements(model, layout) * tokens * 4
        assert outside == pytest.approx(predicted_head, rel=0.05), (outside, predicted_head)


# A subset of tessera bench plan's layouts (docs/planner.md tables all of them), each on fresh
# ranks as the bench measures them: ZeRO-3 (sharded states, gathered layers) with checkpointing
# (a block recomputed in the middle of the backward pass), and a 1F1B pipeline (two micro-batches
# in flight on the first stage; its warm-up must give every stage a block, or the first stage
# counts ~20 MiB of one-time set-up).
PEAK_LAYOUTS = [
    Layout(data=4, micro_batch=2, zero=3, checkpoint="full"),
    Layout(data=2, pipeline=2, schedule="1f1b", microbatches=4, micro_batch=1),
]


def test_predicted_peak_memory_is_within_10_percent_of_measured():
    from tessera.bench.plan import measure

    model = from_gpt_preset("small", seq_len=256)  # the bench's size: activations and states alike
    # memory only (no timed steps), on fresh ranks forked from a server that has imported torch
    rows = measure(PEAK_LAYOUTS, "small", 256, steps=2, timed=0, start_method="forkserver")
    for layout, row in zip(PEAK_LAYOUTS, rows):
        predicted = predict_memory(model, layout, Workload(global_batch=layout.global_batch))
        assert predicted.peak == pytest.approx(row["measured_peak"], rel=0.10), (layout.name(), row, predicted)
        assert predicted.model_states == pytest.approx(row["measured_ledger"], rel=0.02), (layout.name(), row)
