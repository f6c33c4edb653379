"""The byte corpus: deterministic, large enough, split without overlap into next-byte windows."""

from __future__ import annotations

import pytest
import torch

from tessera.data import ByteSequences, byte_datasets, load_byte_corpus
from tessera.data import text as text_module

KIB = 2**10


def test_corpus_is_deterministic_uint8_and_large_enough():
    first, second = load_byte_corpus(), load_byte_corpus()
    assert first.dtype == torch.uint8 and first.ndim == 1
    assert first.numel() >= 256 * KIB
    assert first.numel() <= 4 * 2**20
    assert torch.equal(first, second)
    # Python source: mostly printable ASCII, and plenty of it is code.
    text = bytes(first[: 64 * KIB])
    assert text.count(b"def ") > 10 and text.count(b"import ") > 10


def test_corpus_is_truncated_to_max_bytes_and_prefix_stable():
    short = load_byte_corpus(max_bytes=1000)
    assert short.numel() == 1000
    assert torch.equal(short, load_byte_corpus(max_bytes=5000)[:1000])


def test_corpus_falls_back_to_tessera_sources_when_the_stdlib_has_none(tmp_path, monkeypatch):
    monkeypatch.setattr(text_module, "_stdlib_dir", lambda: tmp_path)
    corpus = load_byte_corpus(max_bytes=2**20)
    assert corpus.dtype == torch.uint8 and corpus.numel() > 10 * KIB
    assert b"tessera" in bytes(corpus)
    assert torch.equal(corpus, load_byte_corpus(max_bytes=2**20))


def test_byte_sequences_shift_targets_by_one():
    tokens = torch.arange(23, dtype=torch.uint8)
    data = ByteSequences(tokens, seq_len=5)
    assert len(data) == (23 - 1) // 5 == 4
    for i, (x, y) in enumerate(data):
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, torch.arange(i * 5, i * 5 + 5))
        assert torch.equal(y, x + 1)
    x_last, _ = data[-1]
    assert torch.equal(x_last, data[3][0])
    with pytest.raises(IndexError):
        data[4]


def test_exactly_seq_len_plus_one_tokens_gives_one_window():
    assert len(ByteSequences(torch.zeros(9, dtype=torch.uint8), seq_len=8)) == 1


def test_train_and_eval_split_the_corpus_without_overlap():
    seq_len, max_bytes, fraction = 64, 100_000, 0.1
    corpus = load_byte_corpus(max_bytes)
    train, evaluation = byte_datasets(seq_len, max_bytes=max_bytes, eval_fraction=fraction)
    n_eval = int(max_bytes * fraction)
    n_train = max_bytes - n_eval
    assert len(train) == (n_train - 1) // seq_len
    assert len(evaluation) == (n_eval - 1) // seq_len
    assert torch.equal(train.tokens, corpus[:n_train])
    assert torch.equal(evaluation.tokens, corpus[n_train:])
    # The last train target ends before the first eval input begins.
    last_target_end = len(train) * seq_len + 1
    assert last_target_end <= n_train
    assert torch.equal(evaluation[0][0], corpus[n_train : n_train + seq_len].long())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seq_len=0), "seq_len=0"),
        (dict(seq_len=8, max_bytes=0), "max_bytes=0"),
        (dict(seq_len=8, eval_fraction=0.0), "eval_fraction=0.0"),
        (dict(seq_len=8, eval_fraction=1.0), "eval_fraction=1.0"),
        (dict(seq_len=8, eval_fraction=-0.5), "eval_fraction=-0.5"),
        (dict(seq_len=64, max_bytes=1000, eval_fraction=0.05), "eval split has 50 tokens"),
    ],
)
def test_byte_datasets_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        byte_datasets(**kwargs)


@pytest.mark.parametrize(
    ("tokens", "seq_len", "message"),
    [
        (torch.zeros(2, 10, dtype=torch.uint8), 4, "1-D"),
        (torch.zeros(10), 4, "integer dtype"),
        (torch.zeros(10, dtype=torch.uint8), 0, "seq_len=0"),
        (torch.zeros(4, dtype=torch.uint8), 4, "too few"),
    ],
)
def test_byte_sequences_rejects_bad_arguments(tokens, seq_len, message):
    with pytest.raises(ValueError, match=message):
        ByteSequences(tokens, seq_len)


def test_load_byte_corpus_rejects_non_positive_max_bytes():
    with pytest.raises(ValueError, match="max_bytes=0"):
        load_byte_corpus(0)
