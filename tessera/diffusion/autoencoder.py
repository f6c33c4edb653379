"""The frozen VAE's pretraining: Stable Diffusion's autoencoder comes trained, and a random one
decodes latents into noise that no caption can be read from. ``fit_vae`` trains the small VAE to
reconstruct every caption's image (a few seconds on a CPU) and sets its scaling factor so that
the latents the UNet sees have unit variance; the UNet's training then keeps it frozen."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.diffusion.data import captions, render
from tessera.diffusion.models import DiffusionParts


def fit_vae(
    parts: DiffusionParts,
    *,
    steps: int = 120,
    lr: float = 3e-3,
    choices: Sequence[tuple[str, str, str]] | None = None,
    seed: int = 0,
) -> float:
    """Train ``parts.vae`` for ``steps`` Adam steps to reconstruct (mean squared error, through
    the latent distribution's mean) the image of every caption (of ``choices``, default all);
    set its ``scaling_factor`` to one over the latents' standard deviation. Returns the last
    reconstruction error."""
    if steps < 0:
        raise ValueError(f"VAE fitting steps={steps} must be at least 0")
    vae = parts.vae
    size = vae.config.sample_size
    images = torch.stack([render(*c, size=size) for c in (choices or captions())])
    vae.requires_grad_(True)
    optimizer = torch.optim.Adam(vae.parameters(), lr=lr)
    error = float("nan")
    torch.manual_seed(seed)
    for _ in range(steps):
        reconstruction = vae.decode(vae.encode(images).latent_dist.mode()).sample
        loss = torch.nn.functional.mse_loss(reconstruction, images)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        error = loss.item()
    vae.requires_grad_(False)
    with torch.no_grad():
        std = vae.encode(images).latent_dist.mode().std().item()
    vae.register_to_config(scaling_factor=1.0 / std)
    return error


__all__ = ["fit_vae"]
