"""The batches that SFT, the reward model, DPO, PPO and GRPO take, from tokenized examples.

Prompt and response are tokenized apart and their ids joined, so the boundary between them is
exact and the training sequence is what generation sees: the prompt's ids, then the generated ones.

Batches are right-padded with ``pad_id`` (default :func:`~tessera.rlhf.data.default_pad_id`);
every mask is false on padding and on prompt tokens, so the id that pads never matters.
``attention_mask`` is int64 1/0 as Hugging Face models take it; tessera's GPT needs none (causal
attention never lets a real token see the padding after it). Alignment, the same in every batch
here: ``logits[:, j]`` (computed from tokens ``0..j``) predict token ``j + 1``. So
``labels[:, j] = tokens[:, j + 1]``, and a mask "on labels" is true at ``j`` when token ``j + 1``
is a response token. :func:`build_rollout_batch` draws it.

Truncation (:class:`SFTDataset`, :class:`PreferenceDataset`): ``max_prompt_len`` keeps the end
of a longer prompt; ``max_len`` cuts the response; a prompt that leaves no room for a response
token is refused with an error naming the example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch
from torch.utils.data import Dataset

from tessera.rlhf.data import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    TextTokenizer,
    as_text_tokenizer,
    default_pad_id,
)

__all__ = [
    "PreferenceDataset",
    "PromptDataset",
    "SFTBatch",
    "SFTDataset",
    "SequenceBatch",
    "TokenizedPair",
    "TokenizedSFT",
    "build_rollout_batch",
    "collate_pairs",
    "collate_prompts",
    "collate_sft",
    "split_pairs",
]


def _check_limit(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name}={value!r} must be an integer of at least {minimum}, or None for no limit")


def _encode_prompt(tokenizer: TextTokenizer, text: str, max_prompt_len: int | None, index: int) -> list[int]:
    """The prompt's ids: the tokenizer's ``prefix_ids``, then the text's last ids that fit."""
    prefix = [int(t) for t in getattr(tokenizer, "prefix_ids", ())]
    ids = list(tokenizer.encode(text))
    if max_prompt_len is not None and len(prefix) + len(ids) > max_prompt_len:
        keep = max_prompt_len - len(prefix)
        if keep < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len} leaves no room after the {len(prefix)} prefix ids")
        ids = ids[-keep:]
    if not prefix + ids:
        raise ValueError(f"example {index}: the prompt is empty (the first response token needs a token before it)")
    return prefix + ids


def _encode_response(tokenizer: TextTokenizer, text: str, add_eos: bool) -> list[int]:
    """The response's ids, with the tokenizer's EOS after them when it has one and ``add_eos``."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return list(tokenizer.encode(text)) + ([int(eos)] if add_eos and eos is not None else [])


def _fit_response(prompt: list[int], response: list[int], max_len: int | None, index: int) -> tuple[list[int], bool]:
    """``response`` cut so that prompt + response has at most ``max_len`` ids; and whether it was cut."""
    if not response:
        raise ValueError(f"example {index}: the response is empty and no EOS is appended to it: nothing to learn")
    if max_len is None:
        return response, False
    room = max_len - len(prompt)
    if room < 1:
        raise ValueError(
            f"example {index}: its prompt is {len(prompt)} tokens, which leaves no room for a response "
            f"within max_len={max_len}; raise max_len, or set max_prompt_len to keep only the end of long prompts"
        )
    return response[:room], len(response) > room


# ---- datasets -----------------------------------------------------------------------------------
class _Encoder:
    """The tokenizer and truncation rules a dataset applies to each of its examples, and the
    count of responses they cut."""

    def __init__(
        self, tokenizer: Any, max_len: int | None, max_prompt_len: int | None, add_eos: bool, pad_id: int | None
    ) -> None:
        _check_limit("max_len", max_len, 2)
        _check_limit("max_prompt_len", max_prompt_len, 1)
        self.tok = as_text_tokenizer(tokenizer)
        self.pad_id = default_pad_id(self.tok) if pad_id is None else pad_id
        self.max_len, self.max_prompt_len, self.add_eos = max_len, max_prompt_len, add_eos
        self.truncated = 0

    def prompt(self, text: str, index: int) -> list[int]:
        return _encode_prompt(self.tok, text, self.max_prompt_len, index)

    def response(self, prompt: list[int], text: str, index: int) -> list[int]:
        ids, cut = _fit_response(prompt, _encode_response(self.tok, text, self.add_eos), self.max_len, index)
        self.truncated += cut
        return ids


@dataclass(frozen=True)
class TokenizedSFT:
    """One SFT example as ids (truncated, EOS included when the tokenizer has one)."""

    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class TokenizedPair:
    """One preference pair as ids: the prompt's, and each response's (cut apart to ``max_len``)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


class SFTDataset(Dataset[TokenizedSFT]):
    """SFT examples tokenized once, as :class:`TokenizedSFT` items; ``collate`` makes an
    :class:`SFTBatch` padded with ``pad_id`` (default: :func:`default_pad_id`).

    ``add_eos``: append the tokenizer's ``eos_token_id`` to each response when it has one, so the
    model learns to stop (the byte tokenizer has none: end the response texts with a stop string).

    Truncation: ``max_prompt_len`` keeps the *end* of a longer prompt (its last tokens, next to
    the response; ``prefix_ids`` such as a BOS stay first). ``max_len`` bounds prompt + response
    (EOS included): a longer response is cut, keeping its beginning (a cut response has no EOS);
    an example whose prompt alone leaves no room for one response token raises ValueError naming
    it. ``truncated`` counts the responses cut. None: no limit.
    """

    def __init__(
        self,
        examples: Sequence[SFTExample],
        tokenizer: Any,
        *,
        max_len: int | None = None,
        max_prompt_len: int | None = None,
        add_eos: bool = True,
        pad_id: int | None = None,
    ) -> None:
        encoder = _Encoder(tokenizer, max_len, max_prompt_len, add_eos, pad_id)
        self.pad_id = encoder.pad_id
        self.items: list[TokenizedSFT] = []
        for index, example in enumerate(examples):
            if isinstance(example, PreferenceExample):
                raise TypeError(f"example {index} is a PreferenceExample: pass sft_from_preferences(examples)")
            prompt = encoder.prompt(example.prompt, index)
            self.items.append(TokenizedSFT(prompt, encoder.response(prompt, example.response, index)))
        self.truncated = encoder.truncated

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedSFT:
        return self.items[index]

    def collate(self, items: Sequence[TokenizedSFT]) -> SFTBatch:
        """:func:`collate_sft` with this dataset's ``pad_id`` (a DataLoader's ``collate_fn``)."""
        return collate_sft(items, self.pad_id)


class PreferenceDataset(Dataset[TokenizedPair]):
    """Preference pairs tokenized once, as :class:`TokenizedPair` items; ``collate`` makes one
    :class:`SequenceBatch` of chosen rows then rejected rows (:func:`collate_pairs`).

    ``add_eos``, ``max_len`` and ``max_prompt_len``: as in :class:`SFTDataset`; the chosen and
    the rejected response are cut apart, each to fit ``max_len`` with the prompt.
    """

    def __init__(
        self,
        examples: Sequence[PreferenceExample],
        tokenizer: Any,
        *,
        max_len: int | None = None,
        max_prompt_len: int | None = None,
        add_eos: bool = True,
        pad_id: int | None = None,
    ) -> None:
        encoder = _Encoder(tokenizer, max_len, max_prompt_len, add_eos, pad_id)
        self.pad_id = encoder.pad_id
        self.items: list[TokenizedPair] = []
        for index, example in enumerate(examples):
            prompt = encoder.prompt(example.prompt, index)
            chosen = encoder.response(prompt, example.chosen, index)
            self.items.append(TokenizedPair(prompt, chosen, encoder.response(prompt, example.rejected, index)))
        self.truncated = encoder.truncated

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedPair:
        return self.items[index]

    def collate(self, items: Sequence[TokenizedPair]) -> SequenceBatch:
        """:func:`collate_pairs` with this dataset's ``pad_id`` (a DataLoader's ``collate_fn``)."""
        return collate_pairs(items, self.pad_id)


class PromptDataset(Dataset[list[int]]):
    """Prompts tokenized once; each item is a list of ids (what the generation engine takes).

    ``examples``: anything with a ``prompt`` (prompt, SFT or preference examples). ``prompts``
    keeps the texts in the same order (reward functions score text). ``max_prompt_len`` keeps the
    last tokens of a longer prompt (``prefix_ids`` such as a BOS stay first). ``pad_id`` (default:
    :func:`default_pad_id`) is for :func:`build_rollout_batch` after generation; ``collate`` is
    :func:`collate_prompts`.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample | SFTExample | PreferenceExample],
        tokenizer: Any,
        *,
        max_prompt_len: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        encoder = _Encoder(tokenizer, None, max_prompt_len, False, pad_id)
        self.pad_id = encoder.pad_id
        self.prompts = [example.prompt for example in examples]
        self.items = [encoder.prompt(text, index) for index, text in enumerate(self.prompts)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> list[int]:
        return list(self.items[index])

    @staticmethod
    def collate(items: Sequence[Sequence[int]]) -> list[list[int]]:
        """:func:`collate_prompts` (a DataLoader's ``collate_fn``)."""
        return collate_prompts(items)


# ---- batches ------------------------------------------------------------------------------------
class SFTBatch(TypedDict):
    """An SFT batch of B examples, T = the longest prompt + response less one.

    Row b holds the example's ids ``x`` (length L) shifted: ``input_ids[b, :L-1] = x[:-1]`` and
    ``labels[b, :L-1] = x[1:]``, so ``logits[b, t]`` predict ``labels[b, t]``; the rest is padding.
    """

    input_ids: torch.Tensor  # [B, T] int64, pad_id after each row's L - 1 inputs
    labels: torch.Tensor  # [B, T] int64, the next token; pad_id on padding
    loss_mask: torch.Tensor  # [B, T] bool, true exactly where labels[b, t] is a response token
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real input tokens, 0 on padding


class SequenceBatch(TypedDict):
    """Whole sequences (prompt + response), right-padded; see :func:`build_rollout_batch`."""

    input_ids: torch.Tensor  # [B, T] int64, prompt then response then pad_id
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens, 0 on padding
    labels: torch.Tensor  # [B, T-1] int64, labels[:, j] = input_ids[:, j + 1]
    response_mask: torch.Tensor  # [B, T-1] bool, true where labels[:, j] is a response token
    last_index: torch.Tensor  # [B] int64, position in input_ids of each row's last real token
    last_label_index: torch.Tensor  # [B] int64, last_index - 1: the same token's position in labels


def _check_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("an empty batch: no rows to collate")
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        if not prompt:
            raise ValueError(f"row {row}: the prompt is empty (the first response token needs a token before it)")
        if not response:
            raise ValueError(
                f"row {row}: the response is empty; a generated response must include the stop token "
                "that ended it (the engine does not return it: append it back)"
            )


def collate_sft(items: Sequence[TokenizedSFT], pad_id: int = 0) -> SFTBatch:
    """B tokenized SFT examples -> an :class:`SFTBatch` [B, T], right-padded with ``pad_id``.

    For an example of prompt ids ``p`` and response ids ``r`` (``x = p + r``, L = len(x)):
    ``loss_mask[b, t]`` is true for ``len(p) - 1 <= t <= L - 2``, the positions whose label is a
    response token; prompt positions and padding never count.
    """
    _check_rows([it.prompt_ids for it in items], [it.response_ids for it in items])
    sequences = [list(it.prompt_ids) + list(it.response_ids) for it in items]
    width = max(len(x) for x in sequences) - 1
    inputs, labels, loss, attention = [], [], [], []
    for item, x in zip(items, sequences):
        n, pad = len(x) - 1, width - (len(x) - 1)
        inputs.append(x[:-1] + [pad_id] * pad)
        labels.append(x[1:] + [pad_id] * pad)
        first = len(item.prompt_ids) - 1
        loss.append([first <= t < n for t in range(width)])
        attention.append([1] * n + [0] * pad)
    return SFTBatch(
        input_ids=torch.tensor(inputs, dtype=torch.int64),
        labels=torch.tensor(labels, dtype=torch.int64),
        loss_mask=torch.tensor(loss, dtype=torch.bool),
        attention_mask=torch.tensor(attention, dtype=torch.int64),
    )


def build_rollout_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> SequenceBatch:
    """Prompts and their responses (lists of ids, no padding) -> a :class:`SequenceBatch` [B, T].

    Row b is ``prompts[b] + responses[b]`` (P + R ids), right-padded with ``pad_id`` to T, the
    longest P + R. ``logits = model(input_ids)`` [B, T, V]: ``logits[:, j]`` predict
    ``input_ids[:, j + 1] = labels[:, j]``, so the log-probabilities of the tokens are::

        logp = log_softmax(logits[:, :-1], -1).gather(-1, labels[..., None])[..., 0]   # [B, T-1]

    and response token k of row b sits at column ``P - 1 + k`` of ``logp``, ``labels`` and
    ``response_mask``. ``last_index[b] = P + R - 1`` is the last response token in ``input_ids``
    (a reward or value head reads the hidden state there); ``last_label_index[b] = P + R - 2``
    is its column in ``logp`` (where PPO puts the sequence's reward). Prompts [5, 6, 7] and [5]
    with responses [8, 9] and [8, 9, 10], ``pad_id=0``::

        column j            0  1  2  3  4
        input_ids[0]        5  6  7  8  9        last_index[0] = 4
        attention_mask[0]   1  1  1  1  1
        labels[0]           6  7  8  9           (labels[:, j] = input_ids[:, j + 1])
        response_mask[0]    F  F  T  T           last_label_index[0] = 3

        input_ids[1]        5  8  9 10  0        last_index[1] = 3
        attention_mask[1]   1  1  1  1  0
        labels[1]           8  9 10  0
        response_mask[1]    T  T  T  F           last_label_index[1] = 2

    A response from the generation engine must include the stop token that ended it (the engine
    does not return it): the policy is then trained to stop. Empty prompts or responses raise.
    """
    _check_rows(prompts, responses)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    inputs, attention, response_mask, last = [], [], [], []
    for prompt, response in zip(prompts, responses):
        x = [int(t) for t in prompt] + [int(t) for t in response]
        inputs.append(x + [pad_id] * (width - len(x)))
        attention.append([1] * len(x) + [0] * (width - len(x)))
        response_mask.append([len(prompt) - 1 <= j < len(x) - 1 for j in range(width - 1)])
        last.append(len(x) - 1)
    input_ids = torch.tensor(inputs, dtype=torch.int64)
    last_index = torch.tensor(last, dtype=torch.int64)
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=torch.tensor(attention, dtype=torch.int64),
        labels=input_ids[:, 1:].clone(),
        response_mask=torch.tensor(response_mask, dtype=torch.bool),
        last_index=last_index,
        last_label_index=last_index - 1,
    )


def collate_pairs(items: Sequence[TokenizedPair], pad_id: int = 0) -> SequenceBatch:
    """B tokenized pairs -> one :class:`SequenceBatch` of 2B rows for a single forward: rows
    ``0..B-1`` are prompt + chosen, rows ``B..2B-1`` prompt + rejected, in the same order.
    Alignment as in :func:`build_rollout_batch`; :func:`split_pairs` splits any per-row result."""
    prompts = [it.prompt_ids for it in items]
    responses = [it.chosen_ids for it in items] + [it.rejected_ids for it in items]
    return build_rollout_batch(prompts + prompts, responses, pad_id)


_Split = TypeVar("_Split", torch.Tensor, list[Any])


def split_pairs(values: _Split) -> tuple[_Split, _Split]:
    """A per-row result of a :func:`collate_pairs` batch ([2B, ...]) -> (chosen [B, ...], rejected [B, ...])."""
    if len(values) % 2:
        raise ValueError(f"{len(values)} rows: a pair batch has an even number (chosen rows, then rejected)")
    half = len(values) // 2
    return values[:half], values[half:]


def collate_prompts(items: Sequence[Sequence[int]]) -> list[list[int]]:
    """B prompts -> a list of B lists of ids, unpadded (what the generation engine takes)."""
    return [[int(t) for t in item] for item in items]
