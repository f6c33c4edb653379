"""A cheap check that samples follow their captions: the mean colour of the half of each image
that its caption names, against the same mean in the rendered image of each colour (same shape,
same position). A sample agrees with its caption when the caption's colour is the nearest."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.diffusion.data import COLOURS, region, render


def region_colours(images: torch.Tensor, choices: Sequence[tuple[str, str, str]]) -> torch.Tensor:
    """``(N, 3)``: the mean colour of the region each caption of ``choices`` names in its image
    (``images``: (N, 3, S, S) in [0, 1], as :func:`~tessera.diffusion.sample` returns)."""
    if len(images) != len(choices):
        raise ValueError(f"{len(images)} images and {len(choices)} captions: one caption per image")
    size = images.shape[-1]
    means = []
    for image, (_, _, position) in zip(images, choices, strict=True):
        rows, columns = region(position, size)
        means.append(image[:, rows, columns].mean((1, 2)))
    return torch.stack(means)


def reference_colours(choice: tuple[str, str, str], size: int = 16) -> torch.Tensor:
    """``(len(COLOURS), 3)``: the named region's mean colour in the rendered image of each colour
    at ``choice``'s shape and position, in [0, 1]."""
    _, shape, position = choice
    rows, columns = region(position, size)
    return torch.stack([((render(c, shape, position, size) + 1) / 2)[:, rows, columns].mean((1, 2)) for c in COLOURS])


def caption_agreement(images: torch.Tensor, choices: Sequence[tuple[str, str, str]]) -> float:
    """The share of ``images`` whose named region's mean colour is nearest (of the four colours'
    renderings, :func:`reference_colours`) to their caption's colour; a quarter is chance."""
    means = region_colours(images, choices)
    size = images.shape[-1]
    names = list(COLOURS)
    hits = [
        int(torch.cdist(mean[None], reference_colours(c, size)).argmin()) == names.index(c[0])
        for mean, c in zip(means, choices, strict=True)
    ]
    return sum(hits) / len(hits)


def colour_error(images: torch.Tensor, choices: Sequence[tuple[str, str, str]]) -> float:
    """The mean distance (RGB in [0, 1]) from each image's named region's mean colour to its
    caption's rendering's."""
    means = region_colours(images, choices)
    size = images.shape[-1]
    names = list(COLOURS)
    targets = torch.stack([reference_colours(c, size)[names.index(c[0])] for c in choices])
    return float((means - targets).norm(dim=1).mean())


__all__ = ["caption_agreement", "colour_error", "reference_colours", "region_colours"]
