"""What a training run of the UNet needs beside the engine: this rank's part of a global batch,
and the engine's weights back in plain diffusers parts (to sample from and save)."""

from __future__ import annotations

from typing import Any

import torch

from tessera.checkpoint import full_state_dict
from tessera.diffusion.data import ShapesDataset, collate
from tessera.diffusion.models import DiffusionParts


def local_batch(data: ShapesDataset, step: int, batch: int, replicas: int, replica: int) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s rows of global batch ``step`` (samples ``step * batch`` onwards):
    ``batch // replicas`` of them, in order, so that the replicas together hold the batch one
    process would train on, noise included."""
    if batch % replicas:
        raise ValueError(f"a global batch of {batch} does not split over {replicas} data-parallel replicas")
    rows = batch // replicas
    start = step * batch + replica * rows
    return collate([data[i] for i in range(start, start + rows)])


def trained_parts(engine: Any, parts: DiffusionParts) -> DiffusionParts:
    """``parts`` with the weights ``engine`` trains (the engine's model is a
    :class:`~tessera.diffusion.NoisePrediction` over them): plain, unsharded copies, whatever the
    layout. Collective (every rank calls it; each gets the whole models)."""
    state = full_state_dict(engine.model)
    models = {}
    for name in ("unet", "text_encoder", "vae"):
        model = _fresh(getattr(parts, name))
        prefix = name + "."
        model.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        models[name] = model.eval()
    return DiffusionParts(**models, tokenizer=parts.tokenizer, scheduler=parts.scheduler)


def _fresh(model: Any) -> Any:
    """A new model of ``model``'s class and config (a sharded model's own parameters may be
    empty between steps, and its blocks may be checkpointed)."""
    if hasattr(model, "from_config"):  # diffusers
        fresh = type(model).from_config(model.config)
        # from_config drops the entries the model was built without, even when register_to_config
        # set them later (fit_vae's scaling_factor): a VAE decoding with the default 0.18215
        # would scale the latents by six and saturate every colour of the samples
        changed = {k: v for k, v in model.config.items() if not k.startswith("_") and fresh.config.get(k) != v}
        fresh.register_to_config(**changed)
        return fresh
    return type(model)(model.config)  # transformers


__all__ = ["local_batch", "trained_parts"]
