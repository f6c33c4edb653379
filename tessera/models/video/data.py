"""Synthetic captioned clips for training a video model: one coloured shape moving across a dark
frame, its caption naming colour, shape and direction ("red square moving right"), and the
rectified-flow training items made from them.

Everything a training item holds is drawn from its global index alone (the clip's content, the
noise and the timestep come from a generator seeded by the dataset's seed and the index), so the
same global batch gets the same noise however the ranks split it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0), "yellow": (1.0, 1.0, -1.0)}
SHAPES = ("square", "circle")
DIRECTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
#: word ids: 0 is padding; the words of every caption after it
VOCAB = ("<pad>", "moving", *COLOURS, *SHAPES, *DIRECTIONS)
CAPTION_LEN = 4
BACKGROUND = -0.8


@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows: a ``colour`` ``shape`` moving in ``direction``."""

    colour: str
    shape: str
    direction: str

    @property
    def caption(self) -> str:
        return f"{self.colour} {self.shape} moving {self.direction}"


def all_specs() -> list[ClipSpec]:
    """Every clip kind, in a fixed order (the dataset cycles through them)."""
    return [ClipSpec(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS]


def caption_ids(caption: str) -> torch.Tensor:
    """Word ids [CAPTION_LEN] of a caption of :data:`VOCAB`'s words (padded with 0)."""
    words = caption.split()
    unknown = [w for w in words if w not in VOCAB]
    if unknown or len(words) > CAPTION_LEN:
        raise ValueError(f"caption {caption!r}: at most {CAPTION_LEN} words of {VOCAB[1:]} (unknown: {unknown})")
    ids = [VOCAB.index(w) for w in words]
    return torch.tensor(ids + [0] * (CAPTION_LEN - len(ids)), dtype=torch.long)


def render(spec: ClipSpec, frames: int, size: int, offset: int = 0) -> torch.Tensor:
    """The clip ``[3, frames, size, size]`` in [-1, 1]: the shape, ``3 * size // 8`` pixels wide
    (a filled square, or a disc: at 3 pixels a plus), crossing the frame in its direction from
    edge to edge in whole pixels, centred across it, ``offset`` pixels off the centre line."""
    side = max(2, 3 * size // 8)
    dr, dc = DIRECTIONS[spec.direction]
    travel = torch.linspace(0, size - side, frames).round().long().tolist()
    across = min(max((size - side) // 2 + offset, 0), size - side)
    yy, xx = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    centre = (side - 1) / 2
    disc = (yy - centre) ** 2 + (xx - centre) ** 2 <= (side / 2 - 0.25) ** 2
    stamp = torch.ones(side, side, dtype=torch.bool) if spec.shape == "square" else disc
    clip = torch.full((3, frames, size, size), BACKGROUND)
    colour = torch.tensor(COLOURS[spec.colour])[:, None, None]
    for f, step in enumerate(travel):
        along = step if (dr + dc) > 0 else size - side - step
        top, left = (along, across) if dr else (across, along)
        patch = clip[:, f, top : top + side, left : left + side]
        clip[:, f, top : top + side, left : left + side] = torch.where(stamp, colour, patch)
    return clip


class MovingShapes(Dataset):
    """``length`` rectified-flow training items over clips of ``frames`` frames of ``size`` x
    ``size`` pixels: item i is a dict of ``latents`` ``x_t = (1 - t) x0 + t noise`` [3, T, H, W],
    ``timesteps`` t [] in (0, 1), ``captions`` [CAPTION_LEN] word ids and the target ``velocity``
    ``noise - x0``; the clip kind cycles with i, its path shifts across by up to a pixel, and the noise and t
    come from a generator seeded by ``(seed, i)``."""

    def __init__(self, length: int, frames: int = 8, size: int = 8, seed: int = 0) -> None:
        if length < 1 or frames < 1 or size < 4:
            raise ValueError(f"MovingShapes needs length >= 1, frames >= 1, size >= 4; got {length}, {frames}, {size}")
        self.length, self.frames, self.size, self.seed = length, frames, size, seed
        self.specs = all_specs()

    def __len__(self) -> int:
        return self.length

    def clip(self, index: int) -> tuple[torch.Tensor, ClipSpec]:
        spec = self.specs[index % len(self.specs)]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        offset = int(torch.randint(-1, 2, (), generator=g))
        return render(spec, self.frames, self.size, offset), spec

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"MovingShapes index {index} out of range {self.length}")
        x0, spec = self.clip(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 2**40)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.rand((), generator=g)
        return {
            "latents": (1 - t) * x0 + t * noise,
            "timesteps": t,
            "captions": caption_ids(spec.caption),
            "velocity": noise - x0,
        }


__all__ = ["CAPTION_LEN", "VOCAB", "ClipSpec", "MovingShapes", "all_specs", "caption_ids", "render"]
