"""Stable Diffusion training on unmodified ``diffusers`` components (docs/diffusion.md).

A ``UNet2DConditionModel`` learns the noise-prediction objective under a frozen ``transformers``
CLIP text encoder and a frozen ``AutoencoderKL``, on synthetic captioned images of coloured
shapes (:mod:`tessera.diffusion.data`). :class:`NoisePrediction` holds the three models and
returns the loss of a batch, so ``tessera.initialize`` trains it under any data-parallel layout
(DP, ZeRO-2/3, Gemini); the frozen encoders are frozen weights there (no gradient, no optimizer
state; sharded and released under ZeRO-3 and Gemini). ``diffusers`` is an optional extra
(``pip install 'tessera[diffusion]'``): it is imported when a model is built, not here.
"""

from tessera.diffusion.autoencoder import fit_vae
from tessera.diffusion.data import ShapesDataset, caption_vocabulary, collate, render
from tessera.diffusion.evaluation import caption_agreement, colour_error
from tessera.diffusion.models import (
    DiffusionParts,
    build_parts,
    checkpoint_unet_blocks,
    load_folder,
    require_diffusers,
    save_folder,
)
from tessera.diffusion.objective import NoisePrediction
from tessera.diffusion.sampling import sample, save_grid
from tessera.diffusion.text_encoder import fit_text_encoder
from tessera.diffusion.training import local_batch, trained_parts

__all__ = [
    "DiffusionParts",
    "NoisePrediction",
    "ShapesDataset",
    "build_parts",
    "caption_agreement",
    "caption_vocabulary",
    "checkpoint_unet_blocks",
    "collate",
    "colour_error",
    "fit_text_encoder",
    "fit_vae",
    "load_folder",
    "local_batch",
    "render",
    "require_diffusers",
    "sample",
    "save_folder",
    "save_grid",
    "trained_parts",
]
