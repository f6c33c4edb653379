"""Stable Diffusion training on unmodified diffusers components (tessera.diffusion): the UNet
under dp2, ZeRO-2 dp2, ZeRO-3 dp2 and Gemini on 2 ranks, with and without activation
checkpointing of its blocks, trains as a plain single-process PyTorch loop on the same global
batch and noise (10 AdamW steps; losses and UNet weights within 1e-5); the frozen text encoder
and VAE are bitwise unchanged and get no gradient or optimizer state. bf16 tracks the fp32 loop
within bf16's tolerance; gradient accumulation and a sharded checkpoint in the middle of the run
give the same answer. The noise and timesteps come with each sample, drawn from its global
index, so that no layout changes them."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.diffusion import NoisePrediction, ShapesDataset, build_parts, checkpoint_unet_blocks, collate, local_batch
from tessera.testing import use_layout

STEPS = 10
BATCH = 8
LR = 1e-3
TOL = {"rtol": 1e-5, "atol": 1e-5}
FROZEN = ("text_encoder.", "vae.")

@pytest.fixture(scope="module", autouse=True)
def _fresh_ranks_afterwards(pools):
    """The models' imports and their freed arenas stay resident in a pool's ranks: the tests after
    these get fresh ranks, as tests that measure memory expect (tests/dist/test_hf_weights.py)."""
    yield
    for world_size in (2,):
        pools.get(world_size).close()



def dataset(parts) -> ShapesDataset:
    return ShapesDataset(STEPS * BATCH, parts.tokenize, parts.latent_shape, seed=7)


def global_batch(data: ShapesDataset, step: int) -> dict[str, torch.Tensor]:
    return local_batch(data, step, BATCH, 1, 0)


def optimizer_of(model: NoisePrediction) -> torch.optim.Optimizer:
    """AdamW over the UNet; eps 1e-4 keeps an element whose gradient is near zero from turning
    the last-bit difference of another summation order into a whole step."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-4, weight_decay=0.01)


def reference(dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch in this process, no tessera: the losses of 10 AdamW steps on the global
    batches and the model's final state."""
    parts = build_parts()
    model = NoisePrediction(parts)
    optimizer = optimizer_of(model)
    data = dataset(parts)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**global_batch(data, step))["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def expected() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference()


GEMINI = {"placement": "auto", "chunk_mb": 0.05, "device_budget": "4.5MiB", "frozen_tier": "host"}
LAYOUTS = {
    "dp2": {"parallel": {"data": 2}},
    "zero2-dp2": {"parallel": {"data": 2}, "zero": {"stage": 2, "chunk_mb": 0.05}},
    "zero3-dp2": {"parallel": {"data": 2}, "zero": {"stage": 3, "chunk_mb": 0.05}},
    "gemini-dp2": {"parallel": {"data": 2}, "gemini": GEMINI},
}


def engine_for(config: dict, recompute: bool):
    ctx = use_layout(config=config)
    parts = build_parts()
    if recompute:
        assert checkpoint_unet_blocks(parts.unet) == [
            "down_blocks.0",
            "down_blocks.1",
            "up_blocks.0",
            "up_blocks.1",
            "mid_block",
        ]
    model = NoisePrediction(parts)
    engine, *_ = tessera.initialize(model, optimizer_of(model))
    return ctx, parts, engine


def train(config: dict, recompute: bool, steps: range = range(STEPS), setup=None):
    """``steps`` of the UNet under ``config`` (on ``setup``'s engine, else a new one); the losses,
    the full state, and what a frozen weight holds that it should not (a gradient, an optimizer
    state, a place in a step)."""
    ctx, parts, engine = setup or engine_for(config, recompute)
    per_step = tessera.current_config().gradient_accumulation
    data = dataset(parts)
    losses = []
    for step in steps:
        mine = local_batch(data, step, BATCH, ctx.size("data"), ctx.local_rank("data"))
        micro = [{k: v.chunk(per_step)[i] for k, v in mine.items()} for i in range(per_step)]
        losses.append(engine.train_batch(iter(micro)))
    frozen = {id(p): n for n, p in engine.model.named_parameters() if n.startswith(FROZEN)}
    held = [f"gradient of {n}" for n, p in engine.model.named_parameters() if id(p) in frozen and p.grad is not None]
    held += [f"state of {frozen[id(p)]}" for p in engine.optimizer.state if id(p) in frozen]
    stepped = [p for g in engine.optimizer.param_groups for p in g["params"]] + getattr(engine.optimizer, "params", [])
    held += [f"{frozen[id(p)]} stepped" for p in stepped if id(p) in frozen]
    return losses, full_state_dict(engine.model), held, placement(engine)


def placement(engine) -> dict[str, int]:
    """The frozen elements this rank keeps (sharded strategies) and its host tier's peak bytes
    (Gemini)."""
    store = getattr(engine.optimizer, "frozen", None)
    report = engine.strategy.report() if hasattr(engine.strategy, "report") else {}
    return {
        "frozen_kept": sum(c.shard_numel for c in store.chunks) if store is not None else -1,
        "host_peak_bytes": report.get("host_peak_bytes", 0),
    }


def assert_trains_as(expected, losses, state, tol=TOL):
    expected_losses, expected_state = expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tol)
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        if key.startswith(FROZEN):
            assert torch.equal(state[key], value), f"the frozen {key} moved"
        else:
            torch.testing.assert_close(state[key].float(), value, **tol, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unet_trains_as_one_process(pools, expected, layout, recompute):
    frozen = sum(v.numel() for k, v in expected[1].items() if k.startswith(FROZEN))
    for losses, state, held, where in pools.run(2, train, LAYOUTS[layout], recompute, timeout=300):
        assert_trains_as(expected, losses, state)
        assert held == [], "a frozen weight got a gradient, an optimizer state or a step"
        if layout in ("zero3-dp2", "gemini-dp2"):  # the frozen encoders sharded: half each, and chunk padding
            assert 0 < where["frozen_kept"] < 0.6 * frozen, where
        if layout == "gemini-dp2":
            assert where["host_peak_bytes"] > 0, "a 4.5 MiB device budget puts model state on the host tier"


def test_gradient_accumulation_trains_as_one_process(pools, expected):
    config = {**LAYOUTS["zero2-dp2"], "gradient_accumulation": 2}
    for losses, state, *_ in pools.run(2, train, config, True, timeout=300):
        assert_trains_as(expected, losses, state)


def test_bf16_tracks_one_process_bf16(pools):
    """bf16 autocast with fp32 master weights, against the same autocast in a plain loop."""
    expected_bf16 = reference(torch.bfloat16)
    config = {**LAYOUTS["zero3-dp2"], "mixed_precision": {"dtype": "bf16"}}
    for losses, state, held, _ in pools.run(2, train, config, True, timeout=300):
        assert_trains_as(expected_bf16, losses, state, tol={"rtol": 2e-2, "atol": 2e-3})
        assert held == []


def save_half_way(config: dict, folder: str) -> None:
    from tessera.checkpoint import save

    setup = engine_for(config, False)
    train(config, False, range(STEPS // 2), setup)
    save(folder, setup[2])


def resume(config: dict, folder: str):
    from tessera.checkpoint import load

    setup = engine_for(config, True)
    assert load(folder, setup[2]) == STEPS // 2
    return train(config, True, range(STEPS // 2, STEPS), setup)


def test_a_sharded_checkpoint_resumes_in_another_layout(pools, expected, tmp_path):
    """Five steps under ZeRO-3 dp2, saved shard by shard; loaded under Gemini with checkpointed
    blocks, the last five steps end where the plain loop's ten do."""
    folder = str(tmp_path / "ckpt")
    pools.run(2, save_half_way, LAYOUTS["zero3-dp2"], folder, timeout=300)
    for losses, state, held, _ in pools.run(2, resume, LAYOUTS["gemini-dp2"], folder, timeout=300):
        assert_trains_as((expected[0][STEPS // 2 :], expected[1]), losses, state)
        assert held == []


# ---- the diffusers folder -------------------------------------------------------------------------


def train_and_save(config: dict, folder: str):
    """3 steps under ``config``, then the engine's noise predictions for a held-out batch and the
    diffusers folder written from its weights (rank 0)."""
    from tessera.diffusion import save_folder, trained_parts

    setup = engine_for(config, True)
    ctx, parts, engine = setup
    train(config, True, range(3), setup)
    held_out = collate([ShapesDataset(BATCH, parts.tokenize, parts.latent_shape, seed=99)[i] for i in range(BATCH)])
    engine.eval()
    with torch.no_grad():
        predictions = engine(**held_out)["prediction"]
    plain = trained_parts(engine, parts)
    if ctx.rank == 0:
        save_folder(plain, folder)
    return predictions, held_out


@pytest.mark.parametrize("layout", ["zero3-dp2", "gemini-dp2"])
def test_the_diffusers_folder_reproduces_the_parallel_model(pools, tmp_path, layout):
    import diffusers
    from transformers import CLIPTextModel, PreTrainedTokenizerFast

    folder = tmp_path / "sd"
    predictions, batch = pools.run(2, train_and_save, LAYOUTS[layout], str(folder), timeout=300)[0]
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet")
    vae = diffusers.AutoencoderKL.from_pretrained(folder / "vae")
    text_encoder = CLIPTextModel.from_pretrained(folder / "text_encoder")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    scheduler = diffusers.DDPMScheduler.from_pretrained(folder / "scheduler")
    ids = tokenizer(["a red square on the left"], padding="max_length", max_length=8, return_tensors="pt").input_ids
    assert torch.equal(ids, build_parts().tokenize(["a red square on the left"]))
    with torch.no_grad():
        latents = vae.encode(batch["pixel_values"]).latent_dist.mode() * vae.config.scaling_factor
        noisy = scheduler.add_noise(latents, batch["noise"], batch["timesteps"])
        text = text_encoder(batch["input_ids"]).last_hidden_state
        expected = unet(noisy, batch["timesteps"], encoder_hidden_states=text).sample
    torch.testing.assert_close(predictions, expected, **TOL)
