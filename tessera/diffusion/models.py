"""The parts of a small Stable Diffusion, built from configs with random weights (no download):
a ``UNet2DConditionModel``, a ``transformers`` ``CLIPTextModel`` with a word-level tokenizer over
the caption vocabulary, an ``AutoencoderKL`` and a ``DDPMScheduler``; the diffusers folder they
save to and load from; activation checkpointing of the UNet's blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tessera.diffusion.data import caption_vocabulary
from tessera.nn.recompute import checkpoint_blocks

SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>")
#: Tokens of every caption with its start and end tokens ("a red square on the left" is 6 words).
MAX_TOKENS = 8
_UNET_BLOCK = re.compile(r"(down_blocks|up_blocks)\.\d+|mid_block")


def require_diffusers() -> ModuleType:
    """The ``diffusers`` module, or an ImportError saying how to install it."""
    try:
        import diffusers
    except ImportError as error:
        raise ImportError(
            "tessera.diffusion trains diffusers models: pip install 'tessera[diffusion]' (diffusers>=0.30)"
        ) from error
    return diffusers


@dataclass
class DiffusionParts:
    """What a Stable Diffusion pipeline is made of (the names of its diffusers folder)."""

    unet: Any  # diffusers.UNet2DConditionModel
    text_encoder: Any  # transformers.CLIPTextModel
    vae: Any  # diffusers.AutoencoderKL
    tokenizer: Any
    scheduler: Any

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the latents of the VAE's images."""
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        size = self.vae.config.sample_size
        return (self.vae.config.latent_channels, size // factor, size // factor)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """``(len(texts), MAX_TOKENS)`` token ids, padded."""
        return tokenize(self.tokenizer, texts)


def tokenize(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    out = tokenizer(texts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt")
    return out["input_ids"]


def build_tokenizer() -> Any:
    """A word-level tokenizer over :func:`caption_vocabulary` (``<bos> words <eos>``, padded with
    ``<pad>``), as a ``transformers`` ``PreTrainedTokenizerFast`` that saves and loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL, *caption_vocabulary()])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=MAX_TOKENS,
    )


def build_parts(
    *,
    width: int = 16,
    image_size: int = 16,
    text_width: int = 32,
    prediction_type: str = "v_prediction",
    seed: int = 0,
) -> DiffusionParts:
    """A small pipeline's parts with random weights from ``seed`` (the same on every rank).

    ``width``: the UNet's first block's channels (the second has twice as many); ``image_size``:
    the images' side (the latents' is half of it); ``prediction_type``: what the UNet predicts
    (the scheduler's: ``v_prediction``, the default, ``epsilon`` or ``sample``; with the epsilon
    objective the samples did not learn their captions in the example's budgets, docs/diffusion.md)."""
    if width < 8 or width % 8:
        raise ValueError(f"UNet width {width} must be a multiple of 8 (its group norms have 8 groups)")
    diffusers = require_diffusers()
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MAX_TOKENS,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    text_encoder = CLIPTextModel(text_config)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=image_size,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
    )  # fmt: skip
    unet = diffusers.UNet2DConditionModel(
        sample_size=image_size // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(width, 2 * width), norm_num_groups=8, cross_attention_dim=text_width,
        attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )  # fmt: skip
    # clip_sample off, as Stable Diffusion: the latents are not bounded by 1
    scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", clip_sample=False, prediction_type=prediction_type
    )
    return DiffusionParts(unet, text_encoder, vae, tokenizer, scheduler)


def checkpoint_unet_blocks(unet: nn.Module, mode: str = "full") -> list[str]:
    """Recompute the activations of the UNet's down, mid and up blocks in the backward pass
    (tessera's activation checkpointing, :func:`tessera.checkpoint_blocks`); their names."""
    return checkpoint_blocks(unet, lambda name, _: _UNET_BLOCK.fullmatch(name) is not None, mode=mode)


def save_folder(parts: DiffusionParts, folder: str | Path) -> Path:
    """Write a diffusers folder: ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
    ``scheduler/`` (each loads with its class's ``from_pretrained``)."""
    folder = Path(folder)
    for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        getattr(parts, name).save_pretrained(folder / name)
    return folder


def load_folder(folder: str | Path) -> DiffusionParts:
    """The parts of a folder that :func:`save_folder` wrote, with plain diffusers and transformers."""
    diffusers = require_diffusers()
    from transformers import CLIPTextModel, PreTrainedTokenizerFast

    folder = Path(folder)
    missing = [n for n in ("unet", "vae", "text_encoder", "tokenizer", "scheduler") if not (folder / n).is_dir()]
    if missing:
        raise FileNotFoundError(f"{folder} is not a diffusers folder: no {', '.join(missing)}")
    return DiffusionParts(
        unet=diffusers.UNet2DConditionModel.from_pretrained(folder / "unet"),
        text_encoder=CLIPTextModel.from_pretrained(folder / "text_encoder"),
        vae=diffusers.AutoencoderKL.from_pretrained(folder / "vae"),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer"),
        scheduler=diffusers.DDPMScheduler.from_pretrained(folder / "scheduler"),
    )


__all__ = [
    "MAX_TOKENS",
    "DiffusionParts",
    "build_parts",
    "build_tokenizer",
    "checkpoint_unet_blocks",
    "load_folder",
    "require_diffusers",
    "save_folder",
    "tokenize",
]
