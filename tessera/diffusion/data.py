"""Synthetic captioned images: a coloured shape on a dark background, its caption naming the
colour, the shape and the position ("a red square on the left"), so that what a model learned
is visible in its samples.

Every sample also carries the noise and the timestep the objective uses for it, drawn from a
generator seeded by the sample's global index: a data-parallel layout that gives each rank its
part of the global batch trains on exactly the noise one process would draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
SHAPES = ("square", "circle")
POSITIONS = ("left", "right", "top", "bottom")
BACKGROUND = (0.15, 0.15, 0.15)


def captions() -> list[tuple[str, str, str]]:
    """Every (colour, shape, position) a caption can name, in a fixed order."""
    return [(c, s, p) for p in POSITIONS for s in SHAPES for c in COLOURS]


def caption_text(colour: str, shape: str, position: str) -> str:
    return f"a {colour} {shape} on the {position}"


def caption_vocabulary() -> list[str]:
    """The words of every caption (the text encoder's vocabulary, before its special tokens)."""
    return ["a", "on", "the", *COLOURS, *SHAPES, *POSITIONS]


def region(position: str, size: int) -> tuple[slice, slice]:
    """The (rows, columns) of the half of a ``size`` x ``size`` image that ``position`` names."""
    half = size // 2
    whole = slice(0, size)
    return {
        "left": (whole, slice(0, half)),
        "right": (whole, slice(half, size)),
        "top": (slice(0, half), whole),
        "bottom": (slice(half, size), whole),
    }[position]


def render(colour: str, shape: str, position: str, size: int = 16) -> torch.Tensor:
    """The image of a caption: ``(3, size, size)`` in [-1, 1] (the VAE's range)."""
    if colour not in COLOURS or shape not in SHAPES or position not in POSITIONS:
        raise ValueError(
            f"no image for ({colour!r}, {shape!r}, {position!r}): colours {list(COLOURS)}, "
            f"shapes {list(SHAPES)}, positions {list(POSITIONS)}"
        )
    if size < 8 or size % 4:
        raise ValueError(f"image size {size} must be a multiple of 4, at least 8")
    centre = {"left": (0.5, 0.25), "right": (0.5, 0.75), "top": (0.25, 0.5), "bottom": (0.75, 0.5)}[position]
    ys = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    dy = (ys - centre[0]).abs()[:, None]
    dx = (ys - centre[1]).abs()[None, :]
    radius = 0.22
    inside = torch.maximum(dy, dx) <= radius if shape == "square" else dy**2 + dx**2 <= radius**2
    image = torch.tensor(BACKGROUND)[:, None, None].expand(3, size, size).clone()
    image[:, inside] = torch.tensor(COLOURS[colour])[:, None]
    return image * 2 - 1


class ShapesDataset(torch.utils.data.Dataset):
    """``length`` captioned images; item ``i`` is a dict of ``pixel_values`` (3, S, S),
    ``input_ids`` (L,), ``noise`` (the latent shape) and ``timesteps`` (an int64 scalar), all
    a function of ``(seed, i)`` alone. A share ``uncaptioned`` of the samples get the empty
    caption (what classifier-free guidance samples against). ``choices``: the (colour, shape,
    position) triples drawn from (default: all of :func:`captions`)."""

    def __init__(
        self,
        length: int,
        tokenize: Any,
        latent_shape: Sequence[int],
        *,
        image_size: int = 16,
        train_timesteps: int = 1000,
        uncaptioned: float = 0.0,
        choices: Sequence[tuple[str, str, str]] | None = None,
        seed: int = 0,
    ) -> None:
        if length < 1:
            raise ValueError(f"a dataset of {length} samples: length must be at least 1")
        if not 0.0 <= uncaptioned < 1.0:
            raise ValueError(f"uncaptioned={uncaptioned} must be in [0, 1)")
        self.uncaptioned = uncaptioned
        self.length, self.tokenize, self.latent_shape = length, tokenize, tuple(latent_shape)
        self.image_size, self.train_timesteps, self.seed = image_size, train_timesteps, seed
        self.choices = list(choices) if choices is not None else captions()
        unknown = [c for c in self.choices if c not in captions()]
        if unknown or not self.choices:
            raise ValueError(
                f"choices {unknown or '[]'} are not (colour, shape, position) captions of {captions()[:2]}..."
            )

    def __len__(self) -> int:
        return self.length

    def caption_of(self, index: int) -> tuple[str, str, str]:
        return self.choices[self._generator(index, 0).integers(len(self.choices))]

    def _generator(self, index: int, stream: int) -> Any:
        import numpy as np

        return np.random.default_rng([self.seed, index, stream])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of a dataset of {self.length}")
        colour, shape, position = self.caption_of(index)
        g = torch.Generator().manual_seed(int(self._generator(index, 1).integers(2**62)))
        dropped = self._generator(index, 2).random() < self.uncaptioned
        return {
            "pixel_values": render(colour, shape, position, self.image_size),
            "input_ids": self.tokenize(["" if dropped else caption_text(colour, shape, position)])[0],
            "noise": torch.randn(self.latent_shape, generator=g),
            "timesteps": torch.randint(0, self.train_timesteps, (), generator=g),
        }


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch dict (each key gains a leading batch dimension)."""
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


__all__ = [
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "ShapesDataset",
    "caption_text",
    "caption_vocabulary",
    "captions",
    "collate",
    "region",
    "render",
]
