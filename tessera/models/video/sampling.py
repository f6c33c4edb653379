"""Sampling clips from a trained video model (Euler steps of the rectified flow) and writing them
as pictures: a frame strip PNG (a row per clip, a column per frame) and an animated GIF."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera import comm
from tessera.files import write_atomically
from tessera.models.video.data import caption_ids
from tessera.models.video.model import VideoDiT
from tessera.models.video.sequence import FrameSplit, take_frames
from tessera.nn.layers import resolve_context


@torch.no_grad()
def sample(model: VideoDiT, captions: list[str], frames: int, steps: int = 16, seed: int = 0) -> torch.Tensor:
    """Clips ``[len(captions), C, frames, H, W]`` for ``captions``: from noise at t = 1 (drawn whole
    from ``seed``, so every layout starts alike), ``steps`` Euler steps ``x -= dt * v(x, t)`` to
    t = 0. Under sequence parallelism every rank of the axis calls it and runs its frames (the
    model's attention crosses the ranks as in training); each gets the whole clips back."""
    cfg = model.config
    ids = torch.stack([caption_ids(c) for c in captions])
    shape = (len(captions), cfg.in_channels, frames, cfg.height, cfg.width)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    ctx = resolve_context()
    if ctx is not None and ctx.size("sequence") > 1:
        split = FrameSplit(frames, ctx.group("sequence"), ctx.dims.sequence_mode)
        x = take_frames(x, ctx.group("sequence"), split.mode)
    else:
        split = FrameSplit(frames)
    x, ids = x.to(device), ids.to(device)
    for i in range(steps):
        t = 1.0 - i / steps
        v = model(x, torch.full((len(captions),), t, device=device), ids).prediction
        x = x - v / steps
    if split.group is None:
        return x.cpu()
    parts = comm.all_gather(x.unsqueeze(0).contiguous(), split.group, dim=0)
    return split.layout.join(list(parts.cpu()), dim=2)


def _to_pixels(clips: torch.Tensor, scale: int) -> torch.Tensor:
    """``[n, 3, T, H, W]`` in about [-1, 1] -> uint8 ``[n, T, H*scale, W*scale, 3]``."""
    pixels = ((clips.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    pixels = pixels.repeat_interleave(scale, dim=3).repeat_interleave(scale, dim=4)
    return pixels.permute(0, 2, 3, 4, 1).contiguous()


def write_frame_strip(clips: torch.Tensor, path: str | Path, scale: int = 8, gap: int = 2) -> Path:
    """A PNG of ``clips`` [n, 3, T, H, W]: row i is clip i, its frames left to right."""
    from PIL import Image

    pixels = _to_pixels(clips, scale)
    n, t, h, w, _ = pixels.shape
    canvas = torch.full((n * (h + gap) - gap, t * (w + gap) - gap, 3), 255, dtype=torch.uint8)
    for i in range(n):
        for f in range(t):
            canvas[i * (h + gap) : i * (h + gap) + h, f * (w + gap) : f * (w + gap) + w] = pixels[i, f]
    return _save(Image.fromarray(canvas.numpy()), path, "PNG")


def write_gif(clips: torch.Tensor, path: str | Path, scale: int = 8, gap: int = 2, ms_per_frame: int = 200) -> Path:
    """An animated GIF of ``clips`` [n, 3, T, H, W] side by side, looping."""
    from PIL import Image

    pixels = _to_pixels(clips, scale)
    n, t, h, w, _ = pixels.shape
    frames = []
    for f in range(t):
        canvas = torch.full((h, n * (w + gap) - gap, 3), 255, dtype=torch.uint8)
        for i in range(n):
            canvas[:, i * (w + gap) : i * (w + gap) + w] = pixels[i, f]
        frames.append(Image.fromarray(canvas.numpy()))
    return _save(frames[0], path, "GIF", save_all=True, append_images=frames[1:], duration=ms_per_frame, loop=0)


def _save(image: object, path: str | Path, kind: str, **options: object) -> Path:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=kind, **options)  # type: ignore[attr-defined]
    write_atomically(path, buffer.getvalue())
    return Path(path)


__all__ = ["sample", "write_frame_strip", "write_gif"]
