"""Models built under tessera.deferred_init() start, in every layout, from the single-process
initial weights (bitwise), each rank making only what it keeps, and train to the single-process
answer."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import gpt
from tessera.testing import tolerance, use_layout
from tests.dist.test_tp_models import GLOBAL_BATCH, build, criterion, dataset

# the start is compared bitwise; a few AdamW steps then show the deferred model trains alike
# (the narrow builds 4 steps; the presets, larger, 2: past the first step and bias correction)
STEPS = 4
PRESET_STEPS = 2

# name: (pool, data, tensor, mode, depth, pipeline, zero stage) -- the layouts the issue names
CASES = {
    "1d-tp4": (4, None, 4, "1d", 1, 1, None),
    "2d-tp4": (4, None, 4, "2d", 1, 1, None),
    "2.5d-tp8-d2": (8, None, 8, "2.5d", 2, 1, None),
    "3d-tp8": (8, None, 8, "3d", 1, 1, None),
    "pp4-1f1b": (4, None, 1, "1d", 1, 4, None),
    "zero3-dp4": (4, 4, 1, "1d", 1, 1, 3),
    "pp2-tp2-dp2": (8, 2, 2, "1d", 1, 2, None),
}


# the GPT presets at their own sizes (vocabulary 256, 4 and 6 layers): "gpt" and "vit" are
# narrower builds of the same classes
PRESETS = {"gpt-tiny": "tiny", "gpt-small": "small"}
KINDS = ["gpt", "vit", *PRESETS]
BLOCKS = {"gpt": 2, "vit": 2, "gpt-tiny": 4, "gpt-small": 6}


def steps_of(kind: str) -> int:
    return PRESET_STEPS if kind in PRESETS else STEPS


def make(kind: str) -> torch.nn.Module:
    if kind in PRESETS:
        torch.manual_seed(0)
        return gpt(PRESETS[kind])
    return build(kind)


def run(kind: str, case: tuple | None, deferred: bool):
    """Train ``STEPS`` steps; the full state right after ``initialize``, the losses, the final
    full state (rank 0's)."""
    _, data, tensor, mode, depth, pipeline, zero = case or (1, None, 1, "1d", 1, 1, None)
    m = 4 if pipeline > 1 else 1
    parallel = {"data": data, "tensor": {"size": tensor, "mode": mode, "depth": depth}}
    if pipeline > 1:
        parallel["pipeline"] = {"size": pipeline, "schedule": "1f1b", "microbatches": m}
    config = {"parallel": parallel, **({"zero": {"stage": zero}} if zero else {})}
    ctx = use_layout(data=data, tensor=tensor, mode=mode, depth=depth, pipeline=pipeline, config=config)
    if deferred:
        with tessera.deferred_init():
            model = make(kind)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = make(kind)
    family = "vit" if kind == "vit" else "gpt"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(dataset(family), batch_size=GLOBAL_BATCH // (ctx.size("data") * m))
    engine, loader, _, _ = tessera.initialize(model, optimizer, criterion(family), loader)
    initial = full_state_dict(engine)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(steps_of(kind))]
    final = full_state_dict(engine)
    return losses, (initial, final) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def references():
    return {kind: run(kind, None, deferred=False) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_deferred_model_starts_and_trains_as_single_process(pools, references, kind, name):
    case = CASES[name]
    results = pools.run(case[0], run, kind, case, True, timeout=600)
    losses, (initial, final) = results[0]
    ref_losses, (ref_initial, ref_final) = references[kind]
    assert initial.keys() == ref_initial.keys()
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), f"{name}: {key} is not the single-process initial value"
    tol = tolerance(blocks=BLOCKS[kind], steps=steps_of(kind))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], **tol, msg=key)


def test_deferred_single_process_equals_a_normal_build():
    """No layout at all: the replay gives the very tensors (and random state) of a normal build."""
    use_layout(config={})
    normal = run("gpt", None, deferred=False)
    deferred = run("gpt", None, deferred=True)
    assert normal[0] == deferred[0]
    for key, value in normal[1][0].items():
        assert torch.equal(deferred[1][0][key], value), key
