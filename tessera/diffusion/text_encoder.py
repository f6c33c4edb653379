"""The frozen text encoder's pretraining: Stable Diffusion's CLIP text encoder comes trained, its
states telling captions apart; a random one maps every caption to nearly the same states (two
captions that differ in one word have token states a fifth to a third of their norm apart),
which leaves the UNet's cross-attention little to read. ``fit_text_encoder`` trains the small
encoder for a second or two to name each caption's colour, shape and position from its states
(linear read-outs of their mean over the tokens, thrown away afterwards); the UNet's training
then keeps it frozen, as it keeps the VAE that ``fit_vae`` trained."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tessera.diffusion.data import COLOURS, POSITIONS, SHAPES, caption_text, captions
from tessera.diffusion.models import DiffusionParts


def fit_text_encoder(
    parts: DiffusionParts,
    *,
    steps: int = 100,
    lr: float = 3e-3,
    choices: Sequence[tuple[str, str, str]] | None = None,
    seed: int = 0,
) -> float:
    """Train ``parts.text_encoder`` for ``steps`` Adam steps so that linear read-outs of the mean
    of its last hidden states name the colour, the shape and the position of every caption (of
    ``choices``, default all) and "none" of each for the empty caption (cross-entropy, summed
    over the three). Returns the last loss; the read-outs are discarded and the encoder is left
    frozen (``requires_grad`` False, eval mode)."""
    if steps < 0:
        raise ValueError(f"text encoder fitting steps={steps} must be at least 0")
    chosen = list(choices or captions())
    encoder = parts.text_encoder
    ids = parts.tokenize([caption_text(*c) for c in chosen] + [""])
    names = (list(COLOURS), list(SHAPES), list(POSITIONS))
    labels = [torch.tensor([kind.index(c[i]) for c in chosen] + [len(kind)]) for i, kind in enumerate(names)]
    torch.manual_seed(seed)
    width = encoder.config.hidden_size
    heads = torch.nn.ModuleList(torch.nn.Linear(width, len(kind) + 1) for kind in names)
    encoder.requires_grad_(True).train()
    optimizer = torch.optim.Adam([*encoder.parameters(), *heads.parameters()], lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        pooled = encoder(ids).last_hidden_state.mean(1)
        loss = torch.stack(
            [F.cross_entropy(head(pooled), label) for head, label in zip(heads, labels, strict=True)]
        ).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    encoder.requires_grad_(False).eval()
    return loss.item()


__all__ = ["fit_text_encoder"]
