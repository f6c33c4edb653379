"""Hugging Face data through pipeline stages: ``Trainer.fit`` on unmodified transformers models
with a data collator's dict batches read from an iterable dataset, under pp2 x dp2 (1F1B, three
micro-batches per step), gives the losses, the evaluation loss and the weights of plain
single-process transformers on the whole global batch (fp32, ``tessera.testing.tolerance``; HF
state-dict keys).

Each micro-batch dict is the first stage's input, the source every later stage re-derives the
attention mask and positions from, and the last stage's target: its loss is weighed by the
labels it counts over those of the step's micro-batches on every data rank, so that padding and
masked prompts (-100) may fall between the micro-batches and ranks as they do. Two collators:

- left padding to a fixed length: the mask changes the answer (real tokens would attend to the
  padding without it), so it must cross the stages; the stream's short last batch changes the
  micro-batches' rows within a step;
- the collator's own padding, to the longest row of each batch: the sequence length changes
  from micro-batch to micro-batch (activation shapes cross the wire for each new input shape),
  with a user criterion(output, batch) in place of the model's loss.

``(inputs, targets)`` pairs without a criterion are refused on every stage before the schedule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.engine import EvalHook
from tessera.errors import TesseraError
from tessera.testing import use_layout, within
from tests.dist.test_hf_data import SEQ, Collate, Sequences, assert_same_training, build, optimizer_of, tokenizer

PIPELINE, DATA, MICRO, ROWS = 2, 2, 3, 2  # ROWS: rows of one rank's micro-batch
GLOBAL = DATA * MICRO * ROWS  # rows of one optimizer step
ITEMS = 35  # steps of 12, 12 and 11 items: the stream's last batch has 3 rows, 2 on one rank and 1 on the other
EVAL_ITEMS = 12


class LeftPadded:
    """``DataCollatorForLanguageModeling(mlm=False)`` padding on the left to ``SEQ`` tokens (labels
    -100 on the padding), and a prompt of 0-2 tokens per row whose labels are -100 too."""

    def __init__(self) -> None:
        words = tokenizer()
        words.padding_side = "left"
        self.collator = transformers.DataCollatorForLanguageModeling(words, mlm=False, pad_to_multiple_of=SEQ)

    def __call__(self, features):
        batch = self.collator(features)
        for row, mask in enumerate(batch["attention_mask"]):
            start = int((mask == 0).sum())
            batch["labels"][row, start : start + int(batch["input_ids"][row, start]) % 3] = -100
        return batch


def smoothed(output, batch) -> torch.Tensor:
    """A criterion other than the model's own loss: next-token cross-entropy with label smoothing,
    the mean over the counted labels."""
    logits = output.logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, batch["labels"][:, 1:].flatten(), label_smoothing=0.1)


# name: (family, collator, criterion)
CASES = {
    "llama-left-padded": ("llama", LeftPadded, None),
    "gpt2-collator-padding-criterion": ("gpt2", Collate, smoothed),
}


def loss_of(model, batch, criterion, masked: bool = True) -> torch.Tensor:
    inputs = batch if masked else {k: v for k, v in batch.items() if k != "attention_mask"}
    output = model(**inputs)
    return output.loss if criterion is None else criterion(output, batch)


def plain_training(family: str, collate, criterion, masked: bool = True):
    """Single-process transformers, one optimizer step per global batch; then the loss of the
    evaluation stream in one batch, and of its first ``DATA * ROWS`` items."""
    model = build(family)
    optimizer = optimizer_of(model)
    losses, batches = [], list(DataLoader(Sequences(ITEMS), batch_size=GLOBAL, collate_fn=collate))
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_of(model, batch, criterion, masked)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    items = list(Sequences(EVAL_ITEMS, seed=9))
    with torch.no_grad():
        evals = [loss_of(model, collate(part), criterion).item() for part in (items, items[: DATA * ROWS])]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, evals, batches


def fit_through_stages(case: str):
    family, collator, criterion = CASES[case]
    collate = collator()
    pipeline = {"size": PIPELINE, "schedule": "1f1b", "microbatches": MICRO}
    use_layout(pipeline=PIPELINE, data=DATA, config={"parallel": {"data": DATA, "pipeline": pipeline}})
    model = build(family)
    train = DataLoader(Sequences(ITEMS), batch_size=ROWS, collate_fn=collate)
    test = DataLoader(Sequences(EVAL_ITEMS, seed=9), batch_size=ROWS, collate_fn=collate)
    engine, train, test, _ = tessera.initialize(model, optimizer_of(model), criterion, train, test)
    history = tessera.Trainer(engine, [EvalHook(test)]).fit(train, epochs=1)
    eval_batch, _ = engine.eval_batch(iter(test))
    losses = [m["loss"] for m in history]
    return engine.strategy.name, (losses, full_state_dict(engine.model)), history[-1]["eval_loss"], eval_batch


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_of_dict_batches_trains_through_pipeline_stages_as_plain_transformers(pools, case):
    family, collate, criterion = CASES[case]
    losses, state, (eval_loss, eval_first), batches = plain_training(family, collate(), criterion)
    assert len(losses) == 3 and [len(b["input_ids"]) for b in batches] == [12, 12, 11]
    assert all((b["attention_mask"] == 0).any() and (b["labels"] == -100).any() for b in batches)
    if collate is LeftPadded:  # the mask matters: without it the real tokens see the padding
        unmasked, *_ = plain_training(family, collate(), criterion, masked=False)
        assert abs(unmasked[0] - losses[0]) > 1e-3
    else:  # the sequence length changes between the micro-batches
        micro = DataLoader(Sequences(ITEMS), batch_size=DATA * ROWS, collate_fn=collate())
        assert len({b["input_ids"].shape[1] for b in micro}) > 1
    results = pools.run(PIPELINE * DATA, fit_through_stages, case, timeout=300)
    for strategy, got, got_eval, got_eval_first in results:
        assert strategy.startswith("pipeline(1f1b)")
        assert_same_training(got, losses, state)
        assert within(got_eval, eval_loss, blocks=2, steps=len(losses)), (got_eval, eval_loss)
        assert within(got_eval_first, eval_first, blocks=2, steps=len(losses)), (got_eval_first, eval_first)


def pairs_without_a_criterion():
    use_layout(pipeline=2, config={"parallel": {"pipeline": {"size": 2, "microbatches": 2}}})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no criterion
    pair = (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    try:
        engine.train_batch(iter([pair, pair]))
    except TesseraError as exc:
        return str(exc)
    return None


def test_pairs_without_a_criterion_are_refused_on_every_stage_before_the_schedule(pools):
    for message in pools.run(2, pairs_without_a_criterion):
        assert message is not None and "pass criterion=... to initialize" in message
