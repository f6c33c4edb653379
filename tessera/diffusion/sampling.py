"""Images from a trained UNet: DDIM sampling from the caption's text states, decoded by the VAE,
and a grid of them, one per caption, as a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tessera.diffusion.models import DiffusionParts, require_diffusers


@torch.no_grad()
def sample(
    parts: DiffusionParts, texts: Sequence[str], *, steps: int = 25, guidance: float = 1.0, seed: int = 0
) -> torch.Tensor:
    """One image per caption in ``texts``: ``(len(texts), 3, S, S)`` in [0, 1]. DDIM over
    ``steps`` of the training scheduler's schedule, from noise drawn from ``seed``; with
    ``guidance`` > 1, classifier-free guidance against the empty caption."""
    if steps < 1:
        raise ValueError(f"sampling steps={steps} must be at least 1")
    diffusers = require_diffusers()
    scheduler = diffusers.DDIMScheduler.from_config(parts.scheduler.config)
    scheduler.set_timesteps(steps)
    param = next(parts.unet.parameters())
    text = parts.text_encoder(parts.tokenize(list(texts)).to(param.device)).last_hidden_state.to(param.dtype)
    empty = parts.text_encoder(parts.tokenize([""] * len(texts)).to(param.device)).last_hidden_state.to(param.dtype)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((len(texts), *parts.latent_shape), generator=g).to(param.device, param.dtype)
    for t in scheduler.timesteps:
        noise = parts.unet(latents, t, encoder_hidden_states=text).sample
        if guidance != 1.0:
            unconditional = parts.unet(latents, t, encoder_hidden_states=empty).sample
            noise = unconditional + guidance * (noise - unconditional)
        latents = scheduler.step(noise, t, latents).prev_sample
    vae_dtype = next(parts.vae.parameters()).dtype
    images = parts.vae.decode(latents.to(vae_dtype) / parts.vae.config.scaling_factor).sample
    return ((images.float() + 1) / 2).clamp(0, 1).cpu()


def save_grid(images: torch.Tensor, texts: Sequence[str], path: str | Path, *, columns: int = 8) -> Path:
    """A PNG of ``images`` (N, 3, S, S) in [0, 1], each titled with its caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(images)
    if n != len(texts) or n == 0:
        raise ValueError(f"a grid of {n} images needs as many captions; got {len(texts)}")
    columns = min(columns, n)
    rows = -(-n // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(1.6 * columns, 1.9 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, text in zip(axes.flat, images, texts, strict=False):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(text.removeprefix("a ").replace(" on the ", "\n"), fontsize=7)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


__all__ = ["sample", "save_grid"]
