"""A spatial-temporal diffusion transformer for video (Open-Sora's ST-DiT, after Peebles & Xie's
DiT), written from the papers' descriptions.

Video latents ``[B, C, T, H, W]`` are cut into patches of ``patch x patch`` pixels of each frame
(``S = (H / patch) * (W / patch)`` tokens a frame), embedded, and given fixed sine-cosine
positions (2D within the frame, 1D over the frames, from global frame indices). Each block:

1. spatial self-attention among the tokens of one frame,
2. temporal self-attention among the tokens at one patch position across the frames,
3. cross-attention from every token to the caption's word embeddings,
4. an MLP,

each a pre-norm residual branch; the spatial, temporal and MLP branches are modulated by the
timestep and caption (adaLN-zero: a shift and scale of the normalised input and a gate of the
branch, from a zero-initialised projection, so that every block starts as the identity). A final
adaLN layer and a zero-initialised projection give the prediction per patch, unpatchified to
``[B, C, T, H, W]``: the velocity of rectified flow.

Under sequence parallelism each rank holds some of the frames (:mod:`.sequence`): everything but
temporal attention is local to a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm import AxisGroup
from tessera.context.placement import full_numel
from tessera.models.video.sequence import Attend, FrameSplit, take_frames
from tessera.nn.layers import resolve_context


@dataclass(frozen=True)
class VideoDiTConfig:
    """A video diffusion transformer's shape; clips of any frame count (positions are sine-cosine)."""

    in_channels: int = 3
    height: int = 8
    width: int = 8
    patch: int = 2
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 32
    caption_len: int = 4
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("in_channels", "height", "width", "patch", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"VideoDiTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.height % self.patch or self.width % self.patch:
            raise ValueError(
                f"VideoDiTConfig: the frame size {self.height}x{self.width} must be a multiple of patch={self.patch}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"VideoDiTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.d_model % 4:
            raise ValueError(f"VideoDiTConfig.d_model={self.d_model} must be divisible by 4 (2D sine-cosine positions)")

    @property
    def patches_per_frame(self) -> int:
        return (self.height // self.patch) * (self.width // self.patch)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch * self.patch


def patchify(video: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, T, H, W]`` -> ``[B, T, S, C * patch * patch]``, patches in row-major order."""
    b, c, t, h, w = video.shape
    x = video.reshape(b, c, t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(b, t, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, channels: int, height: int, width: int, patch: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: ``[B, T, S, C * patch * patch]`` -> ``[B, C, T, H, W]``."""
    b, t = tokens.shape[:2]
    x = tokens.reshape(b, t, height // patch, width // patch, channels, patch, patch)
    return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, channels, t, height, width)


def sincos(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Sine-cosine embeddings ``[n, dim]`` of ``positions`` [n] (float), as in "Attention Is All You Need"."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with per-sample ``shift``, ``scale`` [B, D] over ``x`` [B, ..., D]."""
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return x * (1 + scale.reshape(view)) + shift.reshape(view)


def _gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * gate.reshape((x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],))


class Attention(nn.Module):
    """Multi-head attention of tokens ``[rows, n, D]`` to ``context`` (itself when None)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, attend: Attend, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        rows, n, d = x.shape
        q = self.q(x).reshape(rows, n, self.n_heads, -1).transpose(1, 2)
        k, v = (
            t.reshape(rows, context.shape[1], self.n_heads, -1).transpose(1, 2) for t in self.kv(context).chunk(2, -1)
        )
        return self.out(attend(q, k, v).transpose(1, 2).reshape(rows, n, d))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


class STBlock(nn.Module):
    """Spatial attention, temporal attention, cross-attention and MLP over ``[B, T, S, D]``."""

    def __init__(self, config: VideoDiTConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.eps
        self.norm_spatial = nn.LayerNorm(d, eps=eps, elementwise_affine=False)
        self.spatial = Attention(d, config.n_heads)
        self.norm_temporal = nn.LayerNorm(d, eps=eps, elementwise_affine=False)
        self.temporal = Attention(d, config.n_heads)
        self.norm_cross = nn.LayerNorm(d, eps=eps)
        self.cross = Attention(d, config.n_heads)
        self.norm_mlp = nn.LayerNorm(d, eps=eps, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(d, config.mlp_ratio * d), nn.GELU(approximate="tanh"), nn.Linear(config.mlp_ratio * d, d)
        )
        self.modulation = nn.Linear(d, 9 * d)  # shift, scale, gate of the spatial, temporal and MLP branches

    def forward(self, x: torch.Tensor, c: torch.Tensor, caption: torch.Tensor, split: FrameSplit) -> torch.Tensor:
        """``x`` [B, T/N, S, D] (this rank's frames), ``c`` [B, D] (timestep and caption),
        ``caption`` [B, L, D] (the words) -> [B, T/N, S, D]."""
        b, t, s, d = x.shape
        mods = self.modulation(F.silu(c)).chunk(9, dim=-1)
        h = modulate(self.norm_spatial(x), mods[0], mods[1]).reshape(b * t, s, d)
        x = x + _gate(self.spatial(h, _attend).reshape(b, t, s, d), mods[2])
        h = modulate(self.norm_temporal(x), mods[3], mods[4])
        x = x + _gate(split.temporal(h, self.temporal), mods[5])
        h = self.norm_cross(x).reshape(b, t * s, d)
        x = x + self.cross(h, _attend, caption).reshape(b, t, s, d)
        return x + _gate(self.mlp(modulate(self.norm_mlp(x), mods[6], mods[7])), mods[8])


class VideoDiT(nn.Module):
    """Noisy latents ``[B, C, T, H, W]``, timesteps ``[B]`` in [0, 1] and caption word ids
    ``[B, L]`` -> the velocity ``[B, C, T, H, W]`` (this rank's frames under sequence parallelism).

    ``velocity`` (the target, as the batch's ``velocity`` key) makes it return the mean squared
    error too (:class:`VideoOutput`), so that dict batches train without a criterion."""

    def __init__(self, config: VideoDiTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.patch_embed = nn.Linear(config.patch_dim, d)
        self.time_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.word_embed = nn.Embedding(config.vocab_size, d)
        self.word_pos = nn.Embedding(config.caption_len, d)
        self.caption_norm = nn.LayerNorm(d, eps=config.eps)
        self.blocks = nn.ModuleList(STBlock(config) for _ in range(config.n_layers))
        self.norm_out = nn.LayerNorm(d, eps=config.eps, elementwise_affine=False)
        self.modulation_out = nn.Linear(d, 2 * d)
        self.proj_out = nn.Linear(d, config.patch_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DiT's initialisation: Xavier-uniform linear weights (the patch embedding's too), zero
        biases, N(0, 0.02) word embeddings and time MLP, and zeros for every adaLN modulation and
        the output projection (adaLN-zero). Drawn in parameter order from the global seed: the
        same in every layout."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                owner = name.rsplit(".", 1)[0]
                if name.endswith("bias") or "modulation" in owner or owner == "proj_out":
                    p.zero_()
                elif owner in ("word_embed", "word_pos") or owner.startswith("time_embed"):
                    p.normal_(0.0, 0.02)
                elif p.dim() == 2:
                    nn.init.xavier_uniform_(p)
                else:
                    p.fill_(1.0)  # LayerNorm scales

    def sequence_tokens(self, batch: Any, group: AxisGroup, mode: str) -> Any:
        """This rank's frames of every clip in ``batch`` (the engine's split under sequence
        parallelism; :func:`~tessera.models.video.sequence.take_frames`)."""
        return take_frames(batch, group, mode)

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        captions: torch.Tensor,
        velocity: torch.Tensor | None = None,
    ) -> VideoOutput:
        cfg = self.config
        if (
            latents.dim() != 5
            or tuple(latents.shape[3:]) != (cfg.height, cfg.width)
            or latents.shape[1] != cfg.in_channels
        ):
            raise ValueError(
                f"VideoDiT takes latents [B, {cfg.in_channels}, T, {cfg.height}, {cfg.width}]; got {tuple(latents.shape)}"
            )
        if captions.dim() != 2 or captions.shape[1] > cfg.caption_len:
            raise ValueError(f"captions must be word ids [B, L <= {cfg.caption_len}]; got {tuple(captions.shape)}")
        split = FrameSplit.of(resolve_context(), latents.shape[2])
        x = self.embed(latents, split)
        words = self.word_embed(captions) + self.word_pos(torch.arange(captions.shape[1], device=captions.device))
        caption = self.caption_norm(words)
        c = self.time_embed(sincos(timesteps * 1000.0, cfg.d_model)) + caption.mean(dim=1)
        for block in self.blocks:
            x = block(x, c, caption, split)
        shift, scale = self.modulation_out(F.silu(c)).chunk(2, dim=-1)
        out = self.proj_out(modulate(self.norm_out(x), shift, scale))
        prediction = unpatchify(out, cfg.in_channels, cfg.height, cfg.width, cfg.patch)
        loss = None if velocity is None else F.mse_loss(prediction, velocity)
        return VideoOutput(prediction, loss)

    def embed(self, latents: torch.Tensor, split: FrameSplit) -> torch.Tensor:
        """Latents -> tokens ``[B, T/N, S, D]`` with spatial and (global) temporal positions."""
        cfg = self.config
        x = self.patch_embed(patchify(latents, cfg.patch))
        rows, cols = cfg.height // cfg.patch, cfg.width // cfg.patch
        grid_r, grid_c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        half = cfg.d_model // 2
        spatial = torch.cat([sincos(grid_r.flatten(), half), sincos(grid_c.flatten(), half)], dim=-1)
        temporal = sincos(split.frame_indices(), cfg.d_model)
        return x + spatial.to(x)[None, None] + temporal.to(x)[None, :, None]

    def num_parameters(self) -> int:
        return sum(full_numel(p) for p in self.parameters())


@dataclass
class VideoOutput:
    """The model's prediction ``[B, C, T, H, W]`` and, given the target, its mean squared error."""

    prediction: torch.Tensor
    loss: torch.Tensor | None = None


__all__ = ["STBlock", "VideoDiT", "VideoDiTConfig", "VideoOutput", "patchify", "sincos", "unpatchify"]
