"""The video model's pieces in one process: patches in and out, shapes, the frame split's
layout and its refusals, the synthetic clips and their flow items."""

from __future__ import annotations

import pytest
import torch

from tessera.comm import AxisGroup
from tessera.models.video import (
    MovingShapes,
    VideoDiT,
    VideoDiTConfig,
    all_specs,
    caption_ids,
    frame_layout,
    patchify,
    render,
    sample,
    take_frames,
    unpatchify,
    write_frame_strip,
    write_gif,
)


def test_patchify_round_trips_and_cuts_each_frame_row_major():
    video = torch.randn(2, 3, 4, 8, 8)
    tokens = patchify(video, 2)
    assert tokens.shape == (2, 4, 16, 12)
    # token 1 of frame 3 is rows 0-1, columns 2-3 of that frame, channels first
    torch.testing.assert_close(tokens[1, 3, 1], video[1, :, 3, 0:2, 2:4].reshape(-1), rtol=0, atol=0)
    assert torch.equal(unpatchify(tokens, 3, 8, 8, 2), video)


def test_the_model_predicts_a_clip_of_the_input_shape_and_its_loss():
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig(d_model=32, n_layers=2))
    batch = MovingShapes(2, frames=4)[0]
    batch = {k: v.unsqueeze(0) for k, v in batch.items()}
    out = model(**batch)
    assert out.prediction.shape == (1, 3, 4, 8, 8)
    # adaLN-zero: the output projection starts at zero, so the first prediction is zero
    assert torch.equal(out.prediction, torch.zeros_like(out.prediction))
    torch.testing.assert_close(out.loss, batch["velocity"].pow(2).mean())
    assert model(batch["latents"], batch["timesteps"], batch["captions"]).loss is None


def test_bad_shapes_and_configs_are_refused_naming_the_numbers():
    model = VideoDiT(VideoDiTConfig(d_model=32))
    with pytest.raises(ValueError, match=r"latents \[B, 3, T, 8, 8\]; got \(1, 3, 4, 6, 6\)"):
        model(torch.zeros(1, 3, 4, 6, 6), torch.zeros(1), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of patch=3"):
        VideoDiTConfig(patch=3)
    with pytest.raises(ValueError, match="divisible by n_heads=5"):
        VideoDiTConfig(d_model=32, n_heads=5)
    with pytest.raises(ValueError, match="unknown"):
        caption_ids("purple square moving right")


def test_frames_split_by_the_modes_layout_and_uneven_clips_are_refused():
    assert frame_layout("ring", 8, 2).pieces(0) == [(0, 2), (6, 2)]  # zigzag: 2N pieces
    assert frame_layout("all_to_all", 6, 2).pieces(1) == [(3, 3)]
    with pytest.raises(ValueError, match="6 frames do not divide by 4; use clips of a multiple of 4 frames"):
        frame_layout("ring", 6, 2)
    with pytest.raises(ValueError, match="7 frames do not divide by 2"):
        frame_layout("all_to_all", 7, 2)
    batch = {"latents": torch.randn(2, 3, 8, 4, 4), "timesteps": torch.rand(2), "captions": torch.ones(2, 8).long()}
    parts = [take_frames(batch, AxisGroup("sequence", (0, 1), r, None), "ring") for r in (0, 1)]
    for part in parts:  # only the clip is cut (the captions have as many entries as the clip has frames)
        assert part["latents"].shape == (2, 3, 4, 4, 4) and part["captions"] is batch["captions"]
    torch.testing.assert_close(parts[0]["latents"][:, :, 2:], batch["latents"][:, :, 6:], rtol=0, atol=0)
    joined = frame_layout("ring", 8, 2).join([p["latents"] for p in parts], dim=2)
    assert torch.equal(joined, batch["latents"])


def test_clips_show_the_captioned_motion_and_items_depend_on_their_index_alone():
    right = render(all_specs()[0], frames=4, size=8)  # red square moving right
    assert all_specs()[0].caption == "red square moving right"
    red = right[0] > 0
    cols = [red[f].nonzero()[:, 1].float().mean().item() for f in range(4)]
    assert cols == sorted(cols) and cols[-1] > cols[0]  # its centre moves right
    data = MovingShapes(8, frames=4, seed=1)
    a, b = data[5], MovingShapes(8, frames=4, seed=1)[5]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # x_t = (1 - t) x0 + t noise and v = noise - x0, so x0 = x_t - t v is the clip
    x0, _ = data.clip(5)
    torch.testing.assert_close(a["latents"] - a["timesteps"] * a["velocity"], x0)
    assert not torch.equal(data[5]["velocity"], data[6]["velocity"])


def test_sampling_writes_a_frame_strip_and_a_gif(tmp_path):
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig(d_model=32, n_layers=1))
    clips = sample(model, ["red square moving right", "blue circle moving down"], frames=4, steps=2)
    assert clips.shape == (2, 3, 4, 8, 8)
    from PIL import Image

    with Image.open(write_frame_strip(clips, tmp_path / "strip.png", scale=4, gap=1)) as strip:
        assert strip.size == (4 * 33 - 1, 2 * 33 - 1)
    with Image.open(write_gif(clips, tmp_path / "clips.gif")) as gif:
        assert gif.n_frames == 4
