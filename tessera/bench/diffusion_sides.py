"""What each rank runs for ``tessera bench diffusion``'s UNet rows: one side (plain DDP, ZeRO-3 or
Gemini, with or without activation checkpointing) builds the small Stable Diffusion of
:mod:`tessera.diffusion` at a given UNet width and trains it on its part of the same global batches,
measured as peak RSS above the rank's resident size before the model was built."""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_MIB = 2**20
SIDES = ("ddp", "ddp+ckpt", "zero3", "zero3+ckpt", "gemini", "gemini+ckpt")


@dataclass(frozen=True)
class UNetCase:
    """``width``: the UNet's first block's channels (the second has twice as many); images of
    ``image_size`` pixels (latents of half that); ``batch`` images a global batch; ``steps``
    measured steps; Gemini's device and host budgets (bytes per rank; the rest of its model state
    on disk: on a CPU the device and the host are the same memory), the device's larger without
    checkpointing (Gemini's device budget holds the traced activations). Every side builds the
    model whole on every rank, then sets up (tessera shards it)."""

    width: int = 128
    image_size: int = 32
    batch: int = 16
    steps: int = 3
    lr: float = 1e-4
    gemini_device: int = 48 * _MIB
    gemini_device_whole: int = 160 * _MIB  # without checkpointing: the traced activations must fit on the device
    gemini_host: int = 16 * _MIB


def _batches(case: UNetCase, replicas: int, replica: int, parts: Any) -> list[dict[str, torch.Tensor]]:
    from tessera.diffusion import ShapesDataset, local_batch

    data = ShapesDataset(
        case.steps * case.batch, parts.tokenize, parts.latent_shape, image_size=case.image_size, seed=0
    )
    return [local_batch(data, step, case.batch, replicas, replica) for step in range(case.steps)]


def _parts(case: UNetCase) -> Any:
    from tessera.diffusion import build_parts

    return build_parts(width=case.width, image_size=case.image_size, seed=0)


def _ddp(case: UNetCase, ckpt: bool) -> tuple[Callable[[dict[str, torch.Tensor]], float], Callable[[], None], Any]:
    """Plain torch DDP over the data ranks, as a diffusers user writes it (checkpointing by
    diffusers' own ``enable_gradient_checkpointing``)."""
    from torch.nn.parallel import DistributedDataParallel

    from tessera import comm
    from tessera.diffusion import NoisePrediction
    from tessera.testing import use_layout

    ctx = use_layout(config={})
    parts = _parts(case)
    if ckpt:
        parts.unet.enable_gradient_checkpointing()
    model = NoisePrediction(parts)
    ddp = DistributedDataParallel(model, process_group=ctx.group("world").pg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=case.lr)
    world = ctx.group("world")

    def step(batch: dict[str, torch.Tensor]) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(**batch)["loss"]
        loss.backward()
        optimizer.step()
        mean = comm.all_reduce(loss.detach().clone(), world)  # the global batch's loss, as the engine reports
        return float(mean) / world.size

    return step, lambda: None, parts


def _tessera(
    case: UNetCase, system: str, ckpt: bool, folder: str
) -> tuple[Callable[..., float], Callable[[], None], Any]:
    import tessera
    from tessera.diffusion import NoisePrediction, checkpoint_unet_blocks
    from tessera.testing import use_layout

    if system == "zero3":
        config: dict[str, Any] = {"zero": {"stage": 3}}
    else:
        device = case.gemini_device if ckpt else case.gemini_device_whole
        gemini = {"placement": "auto", "device_budget": device, "host_budget": case.gemini_host,
                  "offload_dir": folder, "frozen_tier": "disk"}  # fmt: skip
        config = {"gemini": gemini}
    use_layout(config=config)
    parts = _parts(case)  # whole on every rank, as DDP's (tessera.deferred_init cannot replay this UNet yet)
    if ckpt:
        checkpoint_unet_blocks(parts.unet)
    model = NoisePrediction(parts)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=case.lr)
    engine, *_ = tessera.initialize(model, optimizer)
    return (lambda batch: float(engine.train_batch(iter([batch])))), engine.close, parts


def _build(case: UNetCase, side: str, folder: str) -> tuple[Callable[..., float], Callable[[], None], Any]:
    system, _, ckpt = side.partition("+")
    if side not in SIDES:
        raise ValueError(f"no UNet bench side {side!r}; the sides are {', '.join(SIDES)}")
    if system == "ddp":
        return _ddp(case, bool(ckpt))
    return _tessera(case, system, bool(ckpt), folder)


def side_body(side: str, case: UNetCase) -> dict[str, Any]:
    """On every rank: ``side`` trains ``case`` after a warm-up of the same code on a UNet of
    width 8 (imports and one-time set-up outside the measurement). Returns this rank's peak RSS
    above its resident size before the build (``peak``; None where /proc cannot tell), the
    losses (the global batch's, the same on every rank) and the mean time of the steps after
    the first. ``peak`` is the training steps' (the model state each side keeps, its buffers and
    activations), ``setup_peak`` the build's and set-up's before them."""
    import dataclasses

    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap

    with tempfile.TemporaryDirectory() as folder:
        warm = dataclasses.replace(case, width=8, steps=1)
        step, close, parts = _build(warm, side, f"{folder}/warm")
        import torch.distributed as dist

        replicas, replica = dist.get_world_size(), dist.get_rank()
        for batch in _batches(warm, replicas, replica, parts):
            step(batch)
        close()
        del step, close, parts
        gc.collect()
        trim_heap()
        measurable = reset_peak_rss()
        base = peak_rss_bytes()
        step, close, parts = _build(case, side, f"{folder}/run")
        batches = _batches(case, replicas, replica, parts)
        setup = peak_rss_bytes()  # the build's and the set-up's peak (the whole model, then its shards)
        gc.collect()
        trim_heap()
        measurable = reset_peak_rss() and measurable
        losses, times = [], []
        for batch in batches:
            start = time.perf_counter()
            losses.append(step(batch))
            times.append(time.perf_counter() - start)
        peak = peak_rss_bytes()
        close()
    timed = times[1:] or times
    known = measurable and None not in (base, setup, peak)
    return {
        "peak": peak - base if known else None,  # type: ignore[operator]
        "setup_peak": setup - base if known else None,  # type: ignore[operator]
        "losses": losses,
        "step_time": sum(timed) / len(timed),
        "parameters": sum(p.numel() for p in parts.unet.parameters()),
    }


__all__ = ["SIDES", "UNetCase", "side_body"]
