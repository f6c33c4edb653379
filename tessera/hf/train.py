"""A Hugging Face causal language model for ``tessera train --model hf:PATH``
(``model.name = "hf:PATH"``; ``tessera.train`` assembles the run from these parts).

PATH is a local folder holding ``config.json`` and safetensors weights: the model is built by
:func:`tessera.hf.from_pretrained` without memory, and each rank fills what its layout keeps
from the folder at ``initialize``. Or PATH is a ``config.json`` file, or a folder holding no
weights but its ``config.json``: the model gets random weights from that config (its
construction, the model's own initialisation included, replayed when deferred). Either way
the class is the one ``AutoModelForCausalLM`` maps the config to. Nothing is downloaded.

Tokens: a folder with a tokenizer (``tokenizer.json`` or ``tokenizer_config.json``, loaded by
``AutoTokenizer`` from local files only) tokenizes the text, and the model's ``vocab_size``
must cover the tokenizer's ids. Without one, the text's bytes are the token ids (0-255), which
need ``vocab_size >= 256``.

The loss is the next-token cross-entropy of the model's logits against targets shifted one
token on (:class:`CausalLMLoss`, what the model's own ``ForCausalLMLoss`` computes), so that
batches are ``(input_ids, targets)`` pairs, which every layout takes: the tensor modes (logits
gathered whole), pipeline stages (the last one returns the logits) and the sequence axis (each
rank its tokens of both). :class:`SavePretrainedHook` writes the result as a folder plain
``transformers`` loads.

Every check here raises ConfigError naming the rule (NotAvailableError without
``transformers``); ``tessera train`` runs :func:`check_causal_lm` before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.engine import Hook
from tessera.engine.batches import IGNORE_INDEX
from tessera.engine.hooks import TrainingLoop
from tessera.errors import ConfigError, NotAvailableError
from tessera.hf.weights import CONFIG, INDEX, WEIGHTS, from_pretrained, save_pretrained
from tessera.init.recording import deferred_init, forget, recording_of

__all__ = [
    "CausalLM",
    "CausalLMLoss",
    "SavePretrainedHook",
    "build_model",
    "check_causal_lm",
    "find_causal_lm",
    "pipeline_layer_count",
    "sequence_length",
    "tokens_of",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
BYTE_VOCABULARY = 256  # token ids of a text read as bytes: 0-255
LONGEST_DEFAULT_SEQ_LEN = 1024  # data.seq_len's default: the model's context, at most this


def _key(path: str | Path) -> str:
    """How messages name the model: its config key and value."""
    return f"model.name='hf:{path}'"


def _transformers(path: str | Path) -> Any:
    try:
        import transformers
    except ImportError:
        raise NotAvailableError(
            f"{_key(path)} needs transformers, which is not installed: pip install 'tessera[hf]'"
        ) from None
    return transformers


@dataclass(frozen=True)
class CausalLM:
    """A causal LM that ``hf:PATH`` names, read and checked (no weights read): its ``config``
    (``transformers`` PretrainedConfig, with the overrides applied), the class ``cls``
    ``AutoModelForCausalLM`` maps it to, whether the folder has ``weights`` to fine-tune, and
    its ``tokenizer`` (None: the text's bytes are the tokens)."""

    path: Path
    config: Any
    cls: type
    weights: bool
    tokenizer: Any

    @property
    def unit(self) -> str:
        """What one token is (the loss curve's unit)."""
        return "token" if self.tokenizer is not None else "byte"


def _locate(given: str | Path) -> tuple[Path, Path, bool, bool]:
    """``(path, its config.json, has weights, has a tokenizer)`` from the file system alone."""
    path = Path(given).expanduser()
    where = _key(given)
    if not path.exists():
        raise ConfigError(
            f"{where}: {path} does not exist; give a local folder with {CONFIG} (and safetensors weights to "
            f"fine-tune) or a {CONFIG} file (nothing is downloaded)"
        )
    if path.is_file():
        if path.suffix != ".json":
            raise ConfigError(f"{where}: {path} is a file but not a model's config (a .json file such as {CONFIG})")
        return path, path, False, False
    config_file = path / CONFIG
    if not config_file.is_file():
        raise ConfigError(
            f"{where}: the folder {path} has no {CONFIG} (a Hugging Face folder holds {CONFIG} and {WEIGHTS})"
        )
    weights = (path / WEIGHTS).is_file() or (path / INDEX).is_file()
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLED)
    if not weights and pickled:
        raise ConfigError(
            f"{where}: {path} has weights only as {', '.join(pickled)}; tessera reads safetensors ({WEIGHTS}) and "
            "never unpickles: convert them with transformers (from_pretrained, then save_pretrained) where you "
            f"trust the file, or give the {CONFIG} file alone for random weights"
        )
    tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    return path, config_file, weights, tokenizer


def _read_config(given: str | Path, config_file: Path, overrides: Mapping[str, Any]) -> Any:
    transformers = _transformers(given)
    try:
        return transformers.AutoConfig.from_pretrained(str(config_file), local_files_only=True, **overrides)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{_key(given)}: transformers cannot read {config_file}: {exc}") from None


def _causal_lm_class(given: str | Path, config: Any, config_file: Path) -> type:
    mapping = _transformers(given).MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in mapping:
        raise ConfigError(
            f"{_key(given)}: {config_file} describes a {config.model_type!r} model ({type(config).__name__}), which "
            "is not a causal language model: AutoModelForCausalLM has no class for it. tessera train fine-tunes "
            "causal LMs (GPT-2, LLaMA, Qwen2, Mistral, ...)"
        )
    cls: type = mapping[type(config)]
    return cls


def _load_tokenizer(given: str | Path, path: Path) -> Any:
    try:
        return _transformers(given).AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{_key(given)}: the tokenizer in {path} does not load: {exc}") from None


def _check_vocabulary(given: str | Path, config: Any, tokenizer: Any, path: Path) -> None:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ConfigError(f"{_key(given)}: its config has no vocab_size")
    if tokenizer is None and vocab < BYTE_VOCABULARY:
        raise ConfigError(
            f"{_key(given)}: vocab_size={vocab} is below {BYTE_VOCABULARY}. Without a tokenizer in the folder "
            f"({' or '.join(TOKENIZER_FILES)}) tessera train reads the text as bytes, token ids 0-255, which need "
            f"vocab_size >= {BYTE_VOCABULARY}: add the model's tokenizer to the folder, or use a model with at "
            f"least {BYTE_VOCABULARY} tokens"
        )
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"{_key(given)}: the tokenizer in {path} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size={vocab}: every token id must be below vocab_size (have a row of the embedding)"
        )


def find_causal_lm(path: str | Path, overrides: Mapping[str, Any] | None = None) -> CausalLM:
    """Read and check the causal LM at ``path`` (a folder, or a config.json file) with config
    ``overrides`` (``model.options``): the path, its config and the causal LM class it maps to,
    the folder's tokenizer against the vocabulary. No weights are read."""
    local, config_file, weights, has_tokenizer = _locate(path)
    config = _read_config(path, config_file, overrides or {})
    cls = _causal_lm_class(path, config, config_file)
    tokenizer = _load_tokenizer(path, local) if has_tokenizer else None
    _check_vocabulary(path, config, tokenizer, local)
    return CausalLM(local, config, cls, weights, tokenizer)


def sequence_length(lm: CausalLM, seq_len: int | None) -> int:
    """The tokens per sample: ``seq_len`` (``data.seq_len``), which must fit the model's
    context (``max_position_embeddings``), or by default that context, at most 1024."""
    context = getattr(lm.config, "max_position_embeddings", None)
    if seq_len is None:
        if not isinstance(context, int):
            raise ConfigError(
                f"{_key(lm.path)}: its config has no max_position_embeddings to take the sequence length from: "
                "set data.seq_len"
            )
        return min(context, LONGEST_DEFAULT_SEQ_LEN)
    if isinstance(context, int) and seq_len > context:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the model's context: {_key(lm.path)} has "
            f"max_position_embeddings={context}; use data.seq_len <= {context}"
        )
    return seq_len


def check_causal_lm(path: str | Path, overrides: Mapping[str, Any] | None, seq_len: int | None) -> None:
    """What ``tessera train`` checks before any rank starts: :func:`find_causal_lm`,
    :func:`sequence_length`, and for a folder with weights its tensors' keys and shapes against
    the model's (from the files' headers and the model built on the meta device:
    CheckpointError naming the file and the tensors)."""
    lm = find_causal_lm(path, overrides)
    sequence_length(lm, seq_len)
    if lm.weights:
        model = from_pretrained(lm.path, lm.cls, **(overrides or {}))
        rec = recording_of(model.parameters())
        if rec is not None:
            forget(rec)  # never made: the ranks build their own


def pipeline_layer_count(path: str | Path, overrides: Mapping[str, Any] | None = None) -> int | None:
    """How many layers the pipeline cuts the model at ``path`` into: its entry (embeddings),
    each decoder layer, its exit (final norm and head); None for a config without
    ``num_hidden_layers``."""
    _, config_file, _, _ = _locate(path)
    layers = getattr(_read_config(path, config_file, overrides or {}), "num_hidden_layers", None)
    return layers + 2 if isinstance(layers, int) else None


def build_model(lm: CausalLM, overrides: Mapping[str, Any] | None = None, *, deferred: bool = True) -> nn.Module:
    """The causal LM in fp32: with the folder's weights, built deferred (``initialize`` fills
    each rank's part from the folder); else with random weights from the config, deferred when
    ``deferred`` (each rank then makes only what it keeps, with the single-process values)."""
    if lm.weights:
        return from_pretrained(lm.path, lm.cls, **(overrides or {}))
    auto = _transformers(lm.path).AutoModelForCausalLM
    if not deferred:
        built: nn.Module = auto.from_config(lm.config, dtype=torch.float32)
        return built
    with deferred_init():  # the model's own initialisation is recorded at initialize (tessera.hf.apply)
        built = auto.from_config(lm.config, dtype=torch.float32)
    return built


def tokens_of(text: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """The token ids of ``text`` (uint8 bytes [n]): the bytes themselves without a tokenizer, else
    the tokenizer's ids (int64 [m]) of the text decoded as UTF-8 (bad bytes replaced), without
    special tokens."""
    if tokenizer is None:
        return text
    decoded = bytes(text.numpy()).decode("utf-8", errors="replace")
    ids = tokenizer(decoded, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


class CausalLMLoss(nn.Module):
    """Mean next-token cross-entropy of a causal LM's ``output.logits`` [batch, seq, vocab]
    against ``targets`` [batch, seq] (the inputs shifted one token on), in fp32, skipping -100:
    what the model's own ``ForCausalLMLoss`` computes from labels it shifts itself."""

    def forward(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


class SavePretrainedHook(Hook):
    """At the end of the fit every rank joins :func:`tessera.hf.save_pretrained`, which writes
    the model (any layout) as a Hugging Face folder at ``folder`` from rank 0, and rank 0 adds
    the ``tokenizer``'s files when there is one."""

    priority = 60

    def __init__(self, folder: Path, tokenizer: Any = None) -> None:
        self.folder = folder
        self.tokenizer = tokenizer

    def after_fit(self, trainer: TrainingLoop) -> None:
        save_pretrained(trainer.engine, self.folder)
        if self.tokenizer is not None and trainer.engine.ctx.rank == 0:
            self.tokenizer.save_pretrained(str(self.folder))
