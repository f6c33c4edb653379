"""The denoising objective of Stable Diffusion as one module: a trainable UNet beside a frozen
text encoder and a frozen VAE, whose forward takes a batch and returns its loss. What the UNet
predicts is the scheduler's ``prediction_type``: the noise (``epsilon``), the velocity
(``v_prediction``) or the clean latents (``sample``); DDIM sampling reads the same config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.diffusion.models import DiffusionParts

#: The scheduler's ``prediction_type``s the objective trains.
TARGETS = ("epsilon", "v_prediction", "sample")


class NoisePrediction(nn.Module):
    """``forward(pixel_values, input_ids, noise, timesteps) -> {"loss", "prediction"}``.

    ``pixel_values`` (B, 3, S, S) in [-1, 1] are encoded by the VAE (the mean of its latent
    distribution, times its scaling factor; no sampling, so nothing random but ``noise``),
    noised to ``timesteps`` (B,) with ``noise`` (B, C, S/f, S/f) by the scheduler, and the UNet,
    conditioned on the text encoder's last hidden states of ``input_ids`` (B, L), predicts the
    target of the scheduler's ``prediction_type`` (``prediction``, the latents' shape): the noise,
    the velocity ``sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * latents`` or the latents. The
    loss is the mean squared error over every element. The text encoder and the VAE are frozen
    (``requires_grad`` False) and run without autograd."""

    def __init__(self, parts: DiffusionParts) -> None:
        super().__init__()
        self.unet = parts.unet
        self.text_encoder = parts.text_encoder.requires_grad_(False).eval()
        self.vae = parts.vae.requires_grad_(False).eval()
        self.scheduler = parts.scheduler
        if parts.scheduler.config.prediction_type not in TARGETS:
            raise ValueError(
                f"NoisePrediction trains the targets {list(TARGETS)}; the scheduler predicts "
                f"{parts.scheduler.config.prediction_type!r}"
            )

    def train(self, mode: bool = True) -> NoisePrediction:
        """Train mode for the UNet; the frozen encoders stay in eval mode."""
        super().train(mode)
        self.text_encoder.eval()
        self.vae.eval()
        return self

    def encode(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scaled latents of the images and the hidden states of the captions."""
        with torch.no_grad():
            latents = self.vae.encode(pixel_values).latent_dist.mode() * self.vae.config.scaling_factor
            text = self.text_encoder(input_ids).last_hidden_state
        return latents, text

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The UNet's prediction for ``noisy`` latents at ``timesteps`` given ``text``."""
        return self.unet(noisy, timesteps, encoder_hidden_states=text).sample

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if noise.shape[0] != pixel_values.shape[0] or timesteps.shape != (pixel_values.shape[0],):
            raise ValueError(
                f"a batch of {pixel_values.shape[0]} images needs noise (B, C, H, W) and timesteps (B,); "
                f"got noise {tuple(noise.shape)}, timesteps {tuple(timesteps.shape)}"
            )
        latents, text = self.encode(pixel_values, input_ids)
        noisy = self.scheduler.add_noise(latents, noise.to(latents.dtype), timesteps)
        prediction = self.predict(noisy, timesteps, text)
        target = self.target(latents, noise, timesteps)
        return {"loss": F.mse_loss(prediction.float(), target.float()), "prediction": prediction}

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What the UNet learns to predict from the latents noised with ``noise`` to ``timesteps``
        (the velocity in float32, whatever autocast gave the latents)."""
        kind = self.scheduler.config.prediction_type
        if kind == "v_prediction":
            return self.scheduler.get_velocity(latents.float(), noise.float(), timesteps)
        return latents if kind == "sample" else noise


__all__ = ["TARGETS", "NoisePrediction"]
