"""A synthetic preference task small enough to learn on a CPU: sort a short list of digits.

The prompt ``"sort 3 1 2:"`` asks for the digits in order, ``" 1 2 3\\n"``. The newline ends every
answer (``SORTING_STOP``) since the byte tokenizer has no end-of-sequence token. The rejected
answer of a pair has one mistake (the input order, two neighbours swapped, a digit dropped,
duplicated or replaced). :func:`sorting_reward` scores any response with partial credit: the
reward model of the PPO and GRPO examples, and their evaluation.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from tessera.rlhf.data import PreferenceExample

__all__ = [
    "SORTING_STOP",
    "SortingFiles",
    "sorting_examples",
    "sorting_files",
    "sorting_reward",
    "write_sorting_files",
]

SORTING_STOP = "\n"
"""The stop string of the sorting task: every answer ends with it. With ``ByteTokenizer`` generate
with ``stop_token_ids=(10,)`` and, when a request ends on it, append 10 to its tokens before
:func:`build_rollout_batch` (the engine does not return the stop token)."""

SORTING_SEED = 0
SORTING_TRAIN_SIZE = 1000
SORTING_HELDOUT_SIZE = 100
_SORTING_FOLDER = Path(__file__).resolve().parent / "files"
_SORTING_PROMPT = re.compile(r"sort((?: [0-9])+):")
_SORTING_BODY = re.compile(r"(?: [0-9])+")


class SortingFiles(NamedTuple):
    """The shipped sorting task: ``train`` (1000 pairs) and ``heldout`` (100 pairs, other prompts)."""

    train: Path
    heldout: Path


def _sorting_prompt(digits: Sequence[int]) -> str:
    return "sort " + " ".join(str(d) for d in digits) + ":"


def _sorting_answer(digits: Sequence[int]) -> str:
    return "".join(f" {d}" for d in digits) + SORTING_STOP


def _wrong_answer(digits: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """A plausible mistake on sorting ``digits``: (its kind, the wrong digits)."""
    right = sorted(digits)
    unequal = [i for i in range(len(right) - 1) if right[i] != right[i + 1]]
    kinds = (["unsorted"] if digits != right else []) + (["swap"] if unequal else [])
    kind = rng.choice([*kinds, "drop", "duplicate", "replace"])
    wrong = list(digits) if kind == "unsorted" else list(right)
    at = rng.randrange(len(wrong))
    if kind == "swap":
        i = rng.choice(unequal)
        wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    elif kind == "drop":
        del wrong[at]
    elif kind == "duplicate":
        wrong.insert(at, wrong[at])
    elif kind == "replace":
        wrong[at] = rng.choice([d for d in range(10) if d != wrong[at]])
        wrong.sort()
    return kind, wrong


def _sorting_records(n: int, seed: int, min_len: int, max_len: int) -> list[dict[str, str]]:
    """``n`` sorting pairs with distinct prompts, each with the kind of its mistake."""
    if not 2 <= min_len <= max_len:
        raise ValueError(f"min_len={min_len}, max_len={max_len}: need 2 <= min_len <= max_len")
    capacity = sum(10**k for k in range(min_len, max_len + 1))
    if not 0 <= n <= capacity:
        raise ValueError(f"n={n}: there are only {capacity} distinct prompts of {min_len} to {max_len} digits")
    rng = random.Random(seed)
    records: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(records) < n:
        digits = [rng.randrange(10) for _ in range(rng.randint(min_len, max_len))]
        prompt = _sorting_prompt(digits)
        if prompt in seen:
            continue
        seen.add(prompt)
        kind, wrong = _wrong_answer(digits, rng)
        chosen = _sorting_answer(sorted(digits))
        records.append({"prompt": prompt, "chosen": chosen, "rejected": _sorting_answer(wrong), "mistake": kind})
    return records


def sorting_examples(n: int, seed: int, min_len: int = 3, max_len: int = 5) -> list[PreferenceExample]:
    """``n`` pairs of the sorting task with distinct prompts, the same for the same arguments.

    A prompt lists ``min_len`` to ``max_len`` digits (0-9, repeats allowed): ``"sort 3 1 2:"``.
    ``chosen`` is the digits in ascending order, each after a space, then the newline that ends
    every answer: ``" 1 2 3\\n"``. ``rejected``, in the same format, is one plausible mistake: the
    input order, two neighbours swapped, a digit dropped, duplicated or replaced by another.
    """
    return [
        PreferenceExample(r["prompt"], r["chosen"], r["rejected"]) for r in _sorting_records(n, seed, min_len, max_len)
    ]


def sorting_reward(prompt: str, response: str) -> float:
    """The sorting task's score of ``response`` to ``prompt``, in [0, 1]: 1 exactly for the right
    answer with its terminator, 0 for a response with no digit before the first newline.

    Only the text before the first ``SORTING_STOP`` is read (the digits 0-9 in it, in order).
    ``content`` is the mean of the multiset match (digits shared with the answer, counted with
    repeats, over the longer of the two lists) and the order (adjacent pairs not decreasing, over
    the larger pair count of response and answer). The score is
    ``content * (3 + well_formed + terminated) / 5``: ``well_formed`` when that text is exactly
    digits each after one space, ``terminated`` when the newline is there. ``prompt`` must be a
    task prompt (``"sort 3 1 2:"``), else ValueError.
    """
    match = _SORTING_PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"{prompt!r} is not a sorting prompt such as 'sort 3 1 2:'")
    answer = sorted(int(d) for d in match.group(1).split())
    body, stop, _ = response.partition(SORTING_STOP)
    digits = [int(d) for d in re.findall(r"[0-9]", body)]
    if not digits:
        return 0.0
    shared = sum((Counter(digits) & Counter(answer)).values())
    multiset = shared / max(len(digits), len(answer))
    pairs = max(len(digits), len(answer)) - 1
    order = sum(a <= b for a, b in itertools.pairwise(digits)) / pairs if pairs else 1.0
    well_formed = _SORTING_BODY.fullmatch(body) is not None
    return (multiset + order) / 2 * (3 + well_formed + bool(stop)) / 5


def write_sorting_files(folder: str | Path | None = None) -> SortingFiles:
    """Write the sorting task's ``sorting_train.jsonl`` and ``sorting_heldout.jsonl`` into
    ``folder`` (default: the shipped ones, in ``tessera/rlhf/files``) and return their paths.

    Both come from one call ``sorting_examples(1100, seed=0)``: the first 1000 pairs train, the
    last 100 are held out, so no prompt is in both. Each line has ``prompt``, ``chosen``,
    ``rejected`` and ``mistake`` (the kind of the rejected answer). The bytes are the same on
    every run: the shipped files are checked against this.
    """
    target = _SORTING_FOLDER if folder is None else Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    records = _sorting_records(SORTING_TRAIN_SIZE + SORTING_HELDOUT_SIZE, SORTING_SEED, 3, 5)
    files = SortingFiles(target / "sorting_train.jsonl", target / "sorting_heldout.jsonl")
    for path, part in zip(files, (records[:SORTING_TRAIN_SIZE], records[SORTING_TRAIN_SIZE:])):
        path.write_bytes("".join(json.dumps(record) + "\n" for record in part).encode("utf-8"))
    return files


def sorting_files() -> SortingFiles:
    """The paths of the shipped sorting task files (:func:`write_sorting_files` made them)."""
    files = SortingFiles(_SORTING_FOLDER / "sorting_train.jsonl", _SORTING_FOLDER / "sorting_heldout.jsonl")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: this install of tessera lacks its package data (tessera/rlhf/files/*.jsonl)"
            )
    return files
