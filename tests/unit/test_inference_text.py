"""tessera.inference.text: the byte tokenizer and TextStream (UTF-8 held whole, stop strings
cut exactly, nothing emitted taken back), with the byte tokenizer and two small BPE tokenizers
built offline (GPT-2's byte-level BPE; LLaMA's SentencePiece-style BPE with byte fallback)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tessera.inference.text import ByteTokenizer, Decoder, TextStream

BYTES = ByteTokenizer()
MIXED = "hello naïve world — 日本語 🙂 the end"  # 2-, 3- and 4-byte characters


def stream_chunks(tokenizer: Decoder, ids: Sequence[int], stop: Sequence[str] = (), step: int = 1) -> list[str]:
    """What a TextStream emits for ``ids`` pushed ``step`` at a time, then its finish()."""
    stream = TextStream(tokenizer, stop)
    chunks = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    chunks.append(stream.finish())
    assert "".join(chunks) == stream.text
    return chunks


def test_byte_tokenizer_round_trip_and_bad_ids():
    assert BYTES.encode("é") == [0xC3, 0xA9] and BYTES.decode(BYTES.encode(MIXED)) == MIXED
    assert BYTES.decode([0xC3]) == "\ufffd"  # half a character: replaced, not an error
    assert (BYTES.eos_token_id, BYTES.vocab_size, BYTES.chat_template) == (None, 256, None)
    with pytest.raises(ValueError, match="token id 256 "):
        BYTES.decode([104, 256])
    with pytest.raises(ValueError, match="token id -1 "):
        BYTES.decode([-1])


def test_multi_byte_characters_split_across_tokens_come_out_whole():
    chunks = stream_chunks(BYTES, BYTES.encode(MIXED))
    assert "".join(chunks) == MIXED
    assert all("\ufffd" not in c for c in chunks)
    emoji = BYTES.encode("🙂")  # 4 bytes: nothing until the last one
    stream = TextStream(BYTES)
    assert [stream.push([b]) for b in emoji] == ["", "", "", "🙂"]


def test_a_stop_string_spanning_tokens_cuts_before_it():
    stream = TextStream(BYTES, stop=["STOP"])
    ids = BYTES.encode("Hello, world. STOP and more")
    chunks = []
    for i, token in enumerate(ids):
        chunks.append(stream.push([token]))
        assert stream.stopped == (i >= len("Hello, world. STOP") - 1)
    assert "".join(chunks) == stream.text == "Hello, world. "
    assert stream.push(BYTES.encode("more")) == "" and stream.finish() == ""


def test_the_earliest_stop_string_wins_even_within_one_push():
    ids = BYTES.encode("one two three")
    assert "".join(stream_chunks(BYTES, ids, stop=["three", "two"], step=len(ids))) == "one "
    assert "".join(stream_chunks(BYTES, ids, stop=["three", "o t"])) == "one tw"  # "o t" ends "two"


def test_a_held_prefix_that_is_not_a_stop_string_is_emitted_later():
    stream = TextStream(BYTES, stop=["</end>"])
    assert stream.push(BYTES.encode("a </e")) == "a "  # "</e" may be the start of "</end>"
    assert stream.push(BYTES.encode("n")) == ""
    assert stream.push(BYTES.encode("x")) == "</enx"  # it was not
    assert stream.push(BYTES.encode(" <")) == " " and not stream.stopped


def test_finish_flushes_what_was_held():
    stream = TextStream(BYTES, stop=["END"])
    assert stream.push(BYTES.encode("the EN")) == "the "
    assert stream.finish() == "EN" and stream.text == "the EN" and not stream.stopped
    cut = TextStream(BYTES)
    assert cut.push([0xE6, 0x97]) == "" and cut.finish() == "\ufffd"  # a cut character ends as U+FFFD


def test_push_after_finish_raises():
    stream = TextStream(BYTES)
    stream.finish()
    assert stream.finish() == ""
    with pytest.raises(RuntimeError, match="after finish"):
        stream.push([65])
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(BYTES, stop=[""])


# ---- real tokenizers, built offline -----------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """GPT-2's byte-level BPE (transformers' GPT2TokenizerFast) on a vocabulary trained here."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, the world is wide", "naïve café"]
    bpe.train_from_iterator(corpus * 3, vocab_size=300, min_frequency=1, show_progress=False)
    folder: Path = tmp_path_factory.mktemp("gpt2_bpe")
    bpe.save_model(str(folder))
    tokenizer: Decoder = transformers.GPT2TokenizerFast(
        vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt")
    )
    return tokenizer


@pytest.fixture(scope="module")
def llama_style_tokenizer() -> Decoder:
    """A SentencePiece-style BPE as LLaMA's tokenizer.json builds it: "▁" for spaces, byte
    fallback (<0xE6> ...) for characters not in the vocabulary, the leading space stripped."""
    import tokenizers
    import transformers

    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r"), ("▁", "t")]
    for piece in ["▁", *"helowrdtn", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    model = tokenizers.models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")]
    )
    decoders = tokenizers.decoders
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer: Decoder = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    return tokenizer


@pytest.mark.parametrize("which", ["gpt2_tokenizer", "llama_style_tokenizer"])
def test_pushes_add_up_to_the_tokenizer_decode(which: str, request: pytest.FixtureRequest):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer.encode(MIXED)
    whole = tokenizer.decode(ids)
    assert whole == MIXED and any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters are split
    for step in (1, 2, 3):
        chunks = stream_chunks(tokenizer, ids, step=step)
        assert "".join(chunks) == whole and all("\ufffd" not in c for c in chunks)
    cut = stream_chunks(tokenizer, ids, stop=["語 🙂", "wide"])
    assert "".join(cut) == whole[: whole.index("語 🙂")]
