"""Rows of batches (tessera.parallel.batches) and the engine's dict-batch rules
(tessera.engine.batches): cutting every tensor of a batch alike, sharing rows over ranks,
counting the items a loss averages over."""

from __future__ import annotations

import itertools
from collections import UserDict, namedtuple

import pytest
import torch
import transformers

from tessera.engine.batches import loss_items, loss_shifts_labels, output_loss
from tessera.errors import TesseraError
from tessera.parallel.batches import row_share, rows_of, take_rows


def collated(rows: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * 4).reshape(rows, 4)
    return {"input_ids": ids, "attention_mask": torch.ones(rows, 4, dtype=torch.long), "labels": ids.clone()}


def test_rows_of_finds_the_first_batch_dimension():
    assert rows_of(collated(5)) == 5
    assert rows_of((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert rows_of({"scale": torch.tensor(2.0), "x": [torch.zeros(7, 1)]}) == 7  # a scalar has no rows
    assert rows_of({"text": ["a", "b"]}) is None and rows_of(torch.tensor(1.0)) is None


def test_take_rows_cuts_every_key_alike():
    batch = collated(5)
    part = take_rows(batch, 1, 3)
    assert list(part) == list(batch)
    for key in batch:
        assert torch.equal(part[key], batch[key][1:3]), key


def test_take_rows_keeps_containers_and_what_has_no_rows():
    pair = namedtuple("pair", "x y")
    shared = torch.arange(4.0)  # dim 0 is not the rows: kept whole
    batch = UserDict(
        {"x": torch.zeros(6, 2), "nested": (torch.arange(6), [torch.ones(6, 1)]), "shared": shared, "name": "b"}
    )
    part = take_rows(batch, 4, 6)
    assert isinstance(part, dict) and part["name"] == "b" and part["shared"] is shared
    assert isinstance(part["nested"], tuple) and isinstance(part["nested"][1], list)
    assert torch.equal(part["nested"][0], torch.tensor([4, 5])) and part["x"].shape == (2, 2)
    named = take_rows(pair(torch.arange(4), torch.arange(4) * 2), 0, 2)
    assert isinstance(named, pair) and torch.equal(named.y, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"rows \[2, 7\) are not within the batch's 6 rows"):
        take_rows(batch, 2, 7)


@pytest.mark.parametrize(("rows", "size"), [(8, 2), (8, 4), (5, 2), (7, 3), (3, 3), (2, 4)])
def test_row_share_covers_every_row_once_in_order(rows, size):
    shares = [row_share(rows, size, r) for r in range(size)]
    assert shares[0][0] == 0 and shares[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
    sizes = [stop - start for start, stop in shares]
    assert max(sizes) - min(sizes) <= 1
    if rows % size == 0:
        assert sizes == [rows // size] * size
    with pytest.raises(ValueError, match="is not one of"):
        row_share(rows, size, size)


def test_loss_items_counts_the_labels_the_loss_averages_over():
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    assert int(loss_items(batch)) == 5
    assert int(loss_items(batch, shift=True)) == 4  # position 0 predicts nothing in a causal LM
    shifted = {**batch, "shift_labels": torch.tensor([[1, -100, -100, -100], [2, 3, -100, -100]])}
    assert int(loss_items(shifted, shift=True)) == 3  # given already shifted: counted as they are
    assert int(loss_items({"input_ids": torch.zeros(3, 4), "labels": torch.tensor([0, 1, 1])}, shift=True)) == 3
    assert int(loss_items({"x": torch.zeros(6, 2)})) == 6  # no labels: the rows
    with pytest.raises(TesseraError, match="needs tensors with a batch dimension"):
        loss_items({"text": "abc"})


def test_the_causal_shift_is_read_from_the_model():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2))
    classifier = transformers.GPT2ForSequenceClassification(
        transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, pad_token_id=0)
    )
    assert loss_shifts_labels(gpt2) and not loss_shifts_labels(classifier)
    assert not loss_shifts_labels(torch.nn.Linear(2, 2))


def test_output_loss_reads_attribute_or_key_and_says_what_is_missing():
    loss = torch.tensor(1.5)
    assert output_loss(transformers.modeling_outputs.CausalLMOutput(loss=loss)) is loss
    assert output_loss({"loss": loss, "logits": None}) is loss
    with pytest.raises(TesseraError, match=r"no loss for a dict batch .*labels=.*criterion=fn\(output, batch\)"):
        output_loss(transformers.modeling_outputs.CausalLMOutput(logits=torch.zeros(1)))
