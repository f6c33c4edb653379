"""The tokens of a ``tessera rlhf`` stage: the tokenizer of an architecture, and the stop token
ids of a generation config (each stop string must be one token of it)."""

from __future__ import annotations

from typing import Any

from tessera.errors import ConfigError
from tessera.inference.text import ByteTokenizer
from tessera.rlhf.data import HFTokenizer
from tessera.rlhf_pipeline.config import GenerationConfig, ModelSpec


def tokenizer_of(spec: ModelSpec) -> Any:
    """The tokenizer of an architecture: bytes for tessera's GPT; an hf: folder's own (bytes
    when it has none)."""
    if spec.hf_path is None:
        return ByteTokenizer()
    from tessera.hf.train import find_causal_lm

    lm = find_causal_lm(spec.hf_path, spec.options)
    return HFTokenizer(lm.tokenizer) if lm.tokenizer is not None else ByteTokenizer()


def stop_ids(generation: GenerationConfig, tokenizer: Any) -> tuple[int, ...]:
    """The stop token ids: ``stop_token_ids``, each stop string's token, the tokenizer's EOS."""
    ids = [int(t) for t in generation.stop_token_ids]
    for text in generation.stop:
        tokens = list(tokenizer.encode(text))
        if len(tokens) != 1:
            raise ConfigError(
                f"generation.stop: {text!r} is {len(tokens)} tokens of the tokenizer; give one-token stops"
            )
        ids.append(tokens[0])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(int(eos))
    return tuple(dict.fromkeys(ids))
