"""tessera.diffusion in one process: the synthetic data are a function of the sample index, the
tokenizer and the parts round-trip through a diffusers folder, bad input fails naming what is
allowed."""

from __future__ import annotations

import sys

import diffusers  # the diffusion extra: without it this file fails to import, it is not skipped
import pytest
import torch

import tessera
from tessera.diffusion import (
    NoisePrediction,
    ShapesDataset,
    build_parts,
    caption_agreement,
    collate,
    colour_error,
    fit_vae,
    load_folder,
    local_batch,
    render,
    sample,
    save_folder,
    trained_parts,
)
from tessera.diffusion.data import caption_text, region
from tessera.testing import use_layout


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


def test_without_diffusers_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # what `import diffusers` meets when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'tessera\[diffusion\]'"):
        build_parts()


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


def test_the_objective_trains_the_schedulers_prediction_type():
    parts = build_parts(prediction_type="v_prediction")
    model = NoisePrediction(parts)
    data = ShapesDataset(4, parts.tokenize, parts.latent_shape)
    batch = collate([data[i] for i in range(4)])
    latents, _ = model.encode(batch["pixel_values"], batch["input_ids"])
    velocity = parts.scheduler.get_velocity(latents, batch["noise"], batch["timesteps"])
    out = model(**batch)
    assert torch.allclose(out["loss"], torch.nn.functional.mse_loss(out["prediction"], velocity))
    parts.scheduler.register_to_config(prediction_type="flow")
    with pytest.raises(ValueError, match=r"trains the targets \['epsilon', 'v_prediction', 'sample'\]"):
        NoisePrediction(parts)


def test_the_agreement_of_rendered_images_with_their_captions():
    shown = [("red", "circle", "top"), ("yellow", "square", "right"), ("blue", "square", "left")]
    images = torch.stack([(render(*c) + 1) / 2 for c in shown])
    assert caption_agreement(images, shown) == 1.0 and colour_error(images, shown) < 1e-6
    swapped = [("green", "circle", "top"), ("red", "square", "right"), ("yellow", "square", "right")]
    assert caption_agreement(images, swapped) == 0.0 and colour_error(images, swapped) > 0.1
    with pytest.raises(ValueError, match="3 images and 2 captions"):
        caption_agreement(images, shown[:2])


def test_trained_parts_keep_the_vaes_scaling_factor():
    """diffusers' from_config drops a config entry the model was built without (fit_vae registers
    the scaling factor afterwards): trained_parts' copies must keep it, or the samples decode
    latents scaled by the default 0.18215 instead (every colour saturated)."""
    use_layout(config={})
    parts = build_parts(seed=2)
    fit_vae(parts, steps=1)
    model = NoisePrediction(parts)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    try:
        plain = trained_parts(engine, parts)
    finally:
        engine.close()
    assert plain.vae.config.scaling_factor == parts.vae.config.scaling_factor != 0.18215
    assert dict(plain.unet.config) == dict(parts.unet.config)
    assert torch.equal(
        sample(plain, ["a red square on the left"], steps=2), sample(parts, ["a red square on the left"], steps=2)
    )
