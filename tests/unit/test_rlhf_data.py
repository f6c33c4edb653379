"""RLHF data: masks on exactly the response tokens, truncation and padding rules, the pair and
rollout batch layouts (which logits predict which token), JSONL errors that name the file and
line, the sorting task's reward, and the shipped sorting files equal to their regeneration."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tessera.inference.text import ByteTokenizer
from tessera.rlhf import (
    SORTING_STOP,
    DataFileError,
    HFTokenizer,
    PreferenceDataset,
    PreferenceExample,
    PromptDataset,
    PromptExample,
    SFTDataset,
    SFTExample,
    as_text_tokenizer,
    build_rollout_batch,
    collate_pairs,
    default_pad_id,
    load_preferences,
    load_prompts,
    load_sft,
    prompts_from,
    read_jsonl,
    sft_from_preferences,
    sorting_examples,
    sorting_files,
    sorting_reward,
    split_pairs,
    write_sorting_files,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
BYTES = ByteTokenizer()
F, T = False, True


# ---- SFT ----------------------------------------------------------------------------------------
def test_sft_batch_masks_exactly_the_response_labels():
    # "ab:" + "cd\n" = [97, 98, 58] + [99, 100, 10]; "a:" + "b\n" = [97, 58] + [98, 10]
    data = SFTDataset([SFTExample("ab:", "cd\n"), SFTExample("a:", "b\n")], BYTES)
    assert data.pad_id == 0 and data.truncated == 0
    assert (data[0].prompt_ids, data[0].response_ids) == ([97, 98, 58], [99, 100, 10])
    batch = data.collate([data[0], data[1]])
    assert batch["input_ids"].tolist() == [[97, 98, 58, 99, 100], [97, 58, 98, 0, 0]]
    assert batch["labels"].tolist() == [[98, 58, 99, 100, 10], [58, 98, 10, 0, 0]]
    assert batch["loss_mask"].tolist() == [[F, F, T, T, T], [F, T, T, F, F]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["loss_mask"].dtype == torch.bool and batch["attention_mask"].dtype == torch.int64


def test_sft_appends_the_tokenizers_eos_when_it_has_one():
    class WithEos(ByteTokenizer):
        eos_token_id = 3

    item = SFTDataset([SFTExample("a:", "b")], WithEos())[0]
    assert item.response_ids == [98, 3]
    assert SFTDataset([SFTExample("a:", "b")], WithEos(), add_eos=False)[0].response_ids == [98]
    assert default_pad_id(WithEos()) == 3 and default_pad_id(BYTES) == 0


def test_an_empty_response_with_nothing_to_learn_is_refused():
    with pytest.raises(ValueError, match="example 1: the response is empty"):
        SFTDataset([SFTExample("a:", "b"), SFTExample("a:", "")], BYTES)


def test_a_preference_example_given_as_sft_names_the_conversion():
    with pytest.raises(TypeError, match="sft_from_preferences"):
        SFTDataset([PreferenceExample("a", "b", "c")], BYTES)  # type: ignore[list-item]


# ---- truncation ---------------------------------------------------------------------------------
def test_max_len_cuts_the_response_and_keeps_its_beginning():
    data = SFTDataset([SFTExample("ab:", "cdef\n"), SFTExample("a:", "b\n")], BYTES, max_len=5)
    assert data[0].prompt_ids == [97, 98, 58] and data[0].response_ids == [99, 100]
    assert data[1].response_ids == [98, 10]
    assert data.truncated == 1


def test_max_prompt_len_keeps_the_end_of_the_prompt():
    data = SFTDataset([SFTExample("abcd:", "x")], BYTES, max_prompt_len=3)
    assert data[0].prompt_ids == list(b"cd:")
    assert PromptDataset([PromptExample("abcd:")], BYTES, max_prompt_len=2)[0] == list(b"d:")


def test_a_prompt_that_leaves_no_room_for_a_response_is_refused_by_name():
    examples = [SFTExample("a:", "b"), SFTExample("abcd:", "x")]
    with pytest.raises(ValueError, match=r"example 1: its prompt is 5 tokens.*max_len=5"):
        SFTDataset(examples, BYTES, max_len=5)
    with pytest.raises(ValueError, match=r"example 0: its prompt is 5 tokens"):
        PreferenceDataset([PreferenceExample("abcd:", "x", "y")], BYTES, max_len=4)
    with pytest.raises(ValueError, match="max_len=1 must be an integer of at least 2"):
        SFTDataset(examples, BYTES, max_len=1)


def test_chosen_and_rejected_are_cut_apart():
    data = PreferenceDataset([PreferenceExample("a:", "bc\n", "defgh\n")], BYTES, max_len=5)
    assert data[0].chosen_ids == [98, 99, 10] and data[0].rejected_ids == [100, 101, 102]
    assert data.truncated == 1


# ---- pairs and rollouts -------------------------------------------------------------------------
def test_pairs_stack_chosen_rows_then_rejected_rows():
    examples = [PreferenceExample("a:", "b\n", "cc\n"), PreferenceExample("xy:", "z\n", "w\n")]
    data = PreferenceDataset(examples, BYTES, pad_id=7)
    batch = data.collate([data[0], data[1]])
    a, b, c, x, y, z, w, colon, nl = 97, 98, 99, 120, 121, 122, 119, 58, 10
    assert batch["input_ids"].tolist() == [
        [a, colon, b, nl, 7],  # pair 0, chosen
        [x, y, colon, z, nl],  # pair 1, chosen
        [a, colon, c, c, nl],  # pair 0, rejected
        [x, y, colon, w, nl],  # pair 1, rejected
    ]
    assert batch["response_mask"].tolist() == [[F, T, T, F], [F, F, T, T], [F, T, T, T], [F, F, T, T]]
    assert batch["last_index"].tolist() == [3, 4, 4, 4]
    chosen, rejected = split_pairs(batch["input_ids"])
    assert torch.equal(chosen, batch["input_ids"][:2]) and torch.equal(rejected, batch["input_ids"][2:])
    assert split_pairs(["c0", "c1", "r0", "r1"]) == (["c0", "c1"], ["r0", "r1"])
    with pytest.raises(ValueError, match="even number"):
        split_pairs(torch.zeros(3))


def test_rollout_batch_matches_the_documented_example():
    batch = build_rollout_batch([[5, 6, 7], [5]], [[8, 9], [8, 9, 10]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8, 9], [8, 9, 10, 0]]
    assert batch["response_mask"].tolist() == [[F, F, T, T], [T, T, T, F]]
    assert batch["last_index"].tolist() == [4, 3]
    assert batch["last_label_index"].tolist() == [3, 2]


def test_rollout_log_probs_of_the_response_sit_under_the_mask():
    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    batch = build_rollout_batch(prompts, responses, pad_id=0)
    logits = torch.randn(2, batch["input_ids"].shape[1], 11, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["labels"][..., None])[..., 0]
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        # token k of the response is predicted by the logits at the position before it
        expected = [torch.log_softmax(logits[b, len(prompt) - 1 + k], -1)[t] for k, t in enumerate(response)]
        assert torch.equal(logp[b][batch["response_mask"][b]], torch.stack(expected))
        assert logp[b, batch["last_label_index"][b]] == expected[-1]


def test_padding_is_masked_whatever_id_pads():
    batch = build_rollout_batch([[1], [1, 2, 3, 4]], [[5], [6]], pad_id=5)  # the pad id is a real token
    assert batch["input_ids"][0].tolist() == [1, 5, 5, 5, 5]
    assert batch["attention_mask"][0].tolist() == [1, 1, 0, 0, 0]
    assert batch["response_mask"][0].tolist() == [T, F, F, F]


def test_rollout_rows_must_have_a_prompt_and_a_response():
    with pytest.raises(ValueError, match="row 1: the response is empty.*stop token"):
        build_rollout_batch([[1], [2]], [[3], []], pad_id=0)
    with pytest.raises(ValueError, match="row 0: the prompt is empty"):
        build_rollout_batch([[]], [[3]], pad_id=0)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_rollout_batch([[1], [2]], [[3]], pad_id=0)


def test_prompt_dataset_gives_unpadded_lists_through_a_data_loader():
    data = PromptDataset([PromptExample("ab"), PreferenceExample("c", "d", "e")], BYTES)
    assert data.prompts == ["ab", "c"]
    assert next(iter(DataLoader(data, batch_size=2, collate_fn=data.collate))) == [[97, 98], [99]]


# ---- JSONL --------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "response": ', "not valid JSON"),
        ('["a", "b"]', "expected a JSON object, got an array"),
        ('{"prompt": "a"}', "missing field 'response' \\(fields: prompt\\)"),
        ('{"prompt": "a", "response": 3}', "field 'response' must be a string, got a number"),
    ],
)
def test_jsonl_errors_name_the_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "sft.jsonl", ['{"prompt": "p", "response": "r"}', "", line])
    with pytest.raises(DataFileError, match=f"sft.jsonl:3: {message}") as caught:
        load_sft(path)
    assert caught.value.line == 3 and caught.value.path == path


def test_a_preference_file_serves_sft_and_prompts(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", ['{"prompt": "p", "chosen": "c", "rejected": "r", "note": 1}'])
    pairs = load_preferences(path)
    assert pairs == [PreferenceExample("p", "c", "r")]
    assert sft_from_preferences(pairs) == [SFTExample("p", "c")]
    assert load_prompts(path) == prompts_from(pairs) == [PromptExample("p")]
    assert read_jsonl(path) == [{"prompt": "p", "chosen": "c", "rejected": "r", "note": 1}]
    with pytest.raises(DataFileError, match="pairs.jsonl:1: missing field 'response'.*sft_from_preferences"):
        load_sft(path)


# ---- the sorting task ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "score"),
    [
        (" 1 2 3\n", 1.0),  # right, with its terminator
        (" 1 2 3\n garbage after the stop", 1.0),  # only the text before the stop counts
        (" 1 2 3", 0.8),  # right digits, no terminator
        ("1,2,3\n", 0.8),  # right digits, not well formed
        (" 3 1 2\n", 0.75),  # input order: all digits, one of two pairs in order
        (" 1 2\n", (2 / 3 + 1 / 2) / 2),  # a digit dropped
        (" 1 2 3 3\n", (3 / 4 + 1) / 2),  # a digit duplicated
        ("hello\n", 0.0),
        ("", 0.0),
        ("\n 1 2 3", 0.0),  # nothing before the stop
    ],
)
def test_sorting_reward_gives_partial_credit(response, score):
    assert sorting_reward("sort 3 1 2:", response) == pytest.approx(score)


def test_sorting_reward_refuses_a_prompt_that_is_not_the_task():
    with pytest.raises(ValueError, match="not a sorting prompt"):
        sorting_reward("please sort 3 1 2", " 1 2 3\n")


def test_sorting_examples_are_deterministic_and_well_formed():
    examples = sorting_examples(200, seed=3)
    assert examples == sorting_examples(200, seed=3) != sorting_examples(200, seed=4)
    assert len({e.prompt for e in examples}) == 200
    for e in examples:
        assert 3 <= len(e.prompt.split()) - 1 <= 5 and e.chosen.endswith(SORTING_STOP)
        assert sorting_reward(e.prompt, e.chosen) == 1.0 > sorting_reward(e.prompt, e.rejected)
    assert sorting_examples(1, seed=0, min_len=2, max_len=2)[0].prompt.count(" ") == 2


def test_shipped_sorting_files_equal_their_regeneration(tmp_path):
    shipped, fresh = sorting_files(), write_sorting_files(tmp_path)
    for ours, theirs in zip(shipped, fresh):
        assert ours.read_bytes() == theirs.read_bytes(), f"{ours} differs from write_sorting_files()"
    train, heldout = load_preferences(shipped.train), load_preferences(shipped.heldout)
    assert (len(train), len(heldout)) == (1000, 100)
    assert not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert json.loads(shipped.train.read_text().splitlines()[0]).keys() == {"prompt", "chosen", "rejected", "mistake"}


def test_the_package_data_ships_the_sorting_files():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "tessera" / "rlhf"
    shipped = {p for pattern in patterns["tessera.rlhf"] for p in package.glob(pattern)}
    assert set(sorting_files()) <= shipped


# ---- Hugging Face tokenizers --------------------------------------------------------------------
def _tiny_hf_tokenizer():
    """A word-level Hugging Face tokenizer built in memory whose encode puts a BOS first."""
    import tokenizers  # the test extra installs transformers, which brings tokenizers
    import transformers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "sort": 4, "1": 5, "2": 6, "3": 7, ":": 8}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    core.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="[UNK]"
    )


def test_a_hugging_face_tokenizer_encodes_without_special_tokens_but_keeps_its_bos():
    hf = _tiny_hf_tokenizer()
    assert hf.encode("sort 3 1 2:") == [1, 4, 7, 5, 6, 8]
    tok = as_text_tokenizer(hf)
    assert isinstance(tok, HFTokenizer) and tok.prefix_ids == [1]
    data = PreferenceDataset([PreferenceExample("sort 3 1 2:", "1 2 3", "3 1 2")], hf, max_prompt_len=3)
    assert data.pad_id == 0
    assert data[0].prompt_ids == [1, 6, 8]  # the BOS stays first; the end of the prompt is kept
    assert data[0].chosen_ids == [5, 6, 7, 2] and data[0].rejected_ids == [7, 5, 6, 2]  # EOS appended
    assert collate_pairs([data[0]], data.pad_id)["last_index"].tolist() == [6, 6]
