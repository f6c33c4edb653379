"""tessera.diffusion in one process: the synthetic data are a function of the sample index, the
tokenizer and the parts round-trip through a diffusers folder, bad input fails naming what is
allowed, and training makes the samples follow their captions (the colour of the region each
caption names, before and after a short plain run)."""

from __future__ import annotations

import diffusers  # the diffusion extra: without it this file fails to import, it is not skipped
import pytest
import torch

from tessera.diffusion import (
    NoisePrediction,
    ShapesDataset,
    build_parts,
    collate,
    fit_vae,
    load_folder,
    local_batch,
    render,
    sample,
    save_folder,
    save_grid,
)
from tessera.diffusion.data import COLOURS, caption_text, region


def test_a_sample_is_a_function_of_its_index():
    parts = build_parts()
    one = ShapesDataset(64, parts.tokenize, parts.latent_shape, seed=3)
    other = ShapesDataset(1000, parts.tokenize, parts.latent_shape, seed=3)
    for i in (0, 5, 63):
        assert all(torch.equal(one[i][k], other[i][k]) for k in one[i])
    assert not torch.equal(one[0]["noise"], one[1]["noise"])
    assert one[0]["noise"].shape == parts.latent_shape == (4, 8, 8)
    halves = [local_batch(one, 2, 8, 2, r) for r in (0, 1)]
    whole = local_batch(one, 2, 8, 1, 0)
    for key in whole:
        assert torch.equal(torch.cat([h[key] for h in halves]), whole[key])


def test_captions_name_their_image():
    image = render("blue", "square", "right")
    rows, columns = region("right", 16)
    named = image[:, rows, columns].flatten(1)
    assert (named == torch.tensor([-1.0, -1.0, 1.0])[:, None]).all(0).sum() > 20, "a blue shape on the right"
    assert not (image[:, region("left", 16)[0], region("left", 16)[1]] > 0.5).any(), "nothing on the left"
    ids = build_parts().tokenize([caption_text("blue", "square", "right"), ""])
    assert ids.shape == (2, 8) and len(set(ids[0].tolist())) == 8 and ids[1, 2:].eq(0).all()


def test_bad_input_is_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match=r"colours \['red', 'green', 'blue', 'yellow'\]"):
        render("purple", "square", "left")
    with pytest.raises(ValueError, match="UNet width 12 must be a multiple of 8"):
        build_parts(width=12)
    parts = build_parts()
    data = ShapesDataset(8, parts.tokenize, parts.latent_shape)
    with pytest.raises(ValueError, match="global batch of 7 does not split over 2"):
        local_batch(data, 0, 7, 2, 0)
    batch = collate([data[i] for i in range(2)])
    with pytest.raises(ValueError, match=r"needs noise \(B, C, H, W\) and timesteps \(B,\)"):
        NoisePrediction(parts)(**{**batch, "timesteps": batch["timesteps"][:1]})


def test_the_folder_loads_with_plain_diffusers(tmp_path):
    parts = build_parts(seed=4)
    fit_vae(parts, steps=1)
    folder = save_folder(parts, tmp_path / "sd")
    loaded = load_folder(folder)
    assert isinstance(loaded.unet, diffusers.UNet2DConditionModel)
    assert loaded.vae.config.scaling_factor == parts.vae.config.scaling_factor != 0.18215
    for name in ("unet", "vae", "text_encoder"):
        mine, theirs = getattr(parts, name).state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
    assert torch.equal(loaded.tokenize(["a red circle on the top"]), parts.tokenize(["a red circle on the top"]))
    with pytest.raises(FileNotFoundError, match="not a diffusers folder: no unet"):
        load_folder(tmp_path)


def named_colour_hits(images: torch.Tensor, choices: list[tuple[str, str, str]]) -> float:
    """The share of ``images`` (one per caption of ``choices``) whose named region's most
    coloured quarter of pixels is nearest to the caption's colour among the palette."""
    palette = torch.tensor(list(COLOURS.values()))
    hits = 0
    for image, (colour, _, position) in zip(images, choices, strict=True):
        rows, columns = region(position, image.shape[-1])
        pixels = image[:, rows, columns].flatten(1)
        saturation = pixels.max(0).values - pixels.min(0).values
        mean = pixels[:, saturation >= saturation.quantile(0.75)].mean(1)
        hits += int((palette - mean).norm(dim=1).argmin().item() == list(COLOURS).index(colour))
    return hits / len(images)


# The learning check trains on the squares on the left and on the right (8 captions: 4 colours
# at 2 positions), which a tiny UNet learns in a few hundred steps; the example's run over all
# 32 captions takes a few thousand (docs/diffusion.md shows its samples).
CHOICES = [(colour, "square", position) for position in ("left", "right") for colour in COLOURS]
STEPS, BATCH, SEEDS = 400, 16, (0, 1)


def samples(parts) -> tuple[torch.Tensor, list[str]]:
    texts = [caption_text(*c) for c in CHOICES]
    images = torch.cat([sample(parts, texts, steps=20, guidance=3.0, seed=seed) for seed in SEEDS])
    return images, texts * len(SEEDS)


def test_training_makes_the_samples_follow_their_captions(tmp_path):
    torch.manual_seed(0)
    parts = build_parts()
    fit_vae(parts, steps=100)
    before = named_colour_hits(samples(parts)[0], CHOICES * len(SEEDS))
    model = NoisePrediction(parts)
    data = ShapesDataset(STEPS * BATCH, parts.tokenize, parts.latent_shape, uncaptioned=0.1, choices=CHOICES)
    optimizer = torch.optim.AdamW(parts.unet.parameters(), lr=2e-3)
    for step in range(STEPS):
        loss = model(**local_batch(data, step, BATCH, 1, 0))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    images, texts = samples(parts)
    after = named_colour_hits(images, CHOICES * len(SEEDS))
    assert save_grid(images, texts, tmp_path / "grid.png").stat().st_size > 10_000
    assert before <= 0.5 and after >= 0.8, (
        f"named colour right in {before:.0%} of the samples before, {after:.0%} after"
    )
