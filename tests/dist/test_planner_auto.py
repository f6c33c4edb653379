"""``parallel = "auto"``: every rank plans the same layout at launch, and the default GPT (the tiny
preset) trains with it to the single-process answer on the same global batch and seed. With this
machine's memory the planner shards with ZeRO; with a tight ``planner.device_memory`` it must
split the model with tensor parallelism as well."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.config import Config, load_config, parallel_dims, resolve_auto
from tessera.errors import ConfigError
from tessera.models import NextTokenLoss, gpt
from tessera.testing import tolerance, use_layout

RANKS = 4
STEPS = 4
SEQ = 32
MICRO, ACCUMULATION = 2, 2  # the global batch: 2 samples x 4 ranks x 2 micro-batches = 16
GLOBAL_BATCH = MICRO * RANKS * ACCUMULATION


def auto_config(**planner: object) -> dict:
    return {"parallel": "auto", "model": {"name": "gpt", "preset": "tiny"}, "gradient_accumulation": ACCUMULATION,
            "data": {"micro_batch_size": MICRO, "seq_len": SEQ}, "planner": planner}  # fmt: skip


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def train(config: Config | None) -> list[float]:
    """``STEPS`` optimizer steps of the tiny GPT: under ``config``'s layout on this rank's pool, or
    (None) in this process alone with the whole global batch a step."""
    if config is None:
        use_layout(config={})
        micro = GLOBAL_BATCH
    else:
        d = parallel_dims(config, dist.get_world_size())
        use_layout(data=d.data, pipeline=d.pipeline, sequence=d.sequence, tensor=d.tensor, mode=d.tensor_mode,
                   depth=d.tensor_depth, config=config)  # fmt: skip
        micro = config.data.micro_batch_size
    torch.manual_seed(0)
    model = gpt("tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(dataset(), batch_size=micro)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    assert loader is not None
    it = iter(loader)
    return [engine.train_batch(it) for _ in range(STEPS)]


def plan_and_train(source: dict) -> tuple[dict, list[float]]:
    """What launch does on each rank: resolve "auto" for the world, then train with the result."""
    config = resolve_auto(load_config(source), dist.get_world_size(), local_world_size=RANKS)
    chosen = {"parallel": dataclasses.asdict(config.parallel), "zero": config.zero.stage,
              "offload": config.zero.offload_optimizer, "checkpoint": config.activation_checkpoint.mode,
              "micro_batch": config.data.micro_batch_size, "accumulation": config.gradient_accumulation}  # fmt: skip
    return chosen, train(config)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return train(None)


def global_batch(chosen: dict) -> int:
    pipeline = chosen["parallel"]["pipeline"]
    per_step = pipeline["microbatches"] if pipeline["size"] > 1 else chosen["accumulation"]
    return chosen["micro_batch"] * chosen["parallel"]["data"] * per_step


@pytest.mark.parametrize(
    ("memory", "split"),
    [
        (None, lambda p, chosen: chosen["zero"] > 0),  # this machine's memory: ZeRO shards the states
        ("6MiB", lambda p, chosen: p["tensor"]["size"] > 1 or p["pipeline"]["size"] > 1),  # the model must be split
    ],
    ids=["machine-memory", "6MiB"],
)
def test_auto_layout_trains_to_the_single_process_answer(pools, reference, memory, split):
    source = auto_config(**({"device_memory": memory} if memory else {}))
    results = pools.run(RANKS, plan_and_train, source, timeout=300)
    chosen, losses = results[0]
    assert all(r[0] == chosen for r in results), "every rank plans the same layout"
    assert global_batch(chosen) == GLOBAL_BATCH, "the global batch stays what the config implies"
    assert chosen["parallel"]["auto"] is False and split(chosen["parallel"], chosen), chosen
    assert all(r[1] == losses for r in results)
    # gpt("tiny"): 4 blocks
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), **tolerance(blocks=4, steps=STEPS))


def test_auto_reports_a_memory_that_nothing_fits():
    with pytest.raises(ConfigError, match=r'parallel="auto": no layout of gpt:tiny fits 4 devices of 1.0 MiB'):
        resolve_auto(load_config(auto_config(device_memory="1MiB")), RANKS, local_world_size=RANKS)


def test_auto_is_a_shorthand_that_names_its_conflicts():
    assert load_config({"parallel": "auto"}).parallel.auto is True
    assert load_config({"parallel": "auto"}, ["parallel.auto=false"]).parallel.auto is False
    with pytest.raises(ConfigError, match=r"parallel.auto=True lets the planner choose the whole layout, and "
                                          r"parallel.tensor is set too"):  # fmt: skip
        load_config({"parallel": {"auto": True, "tensor": 2}})
    with pytest.raises(ConfigError, match=r'parallel="auto" is chosen at launch'):
        parallel_dims(load_config({"parallel": "auto"}), 4)
    with pytest.raises(ConfigError, match=r"planner.hardware='tpu' is not known"):
        load_config({"parallel": "auto", "planner": {"hardware": "tpu"}})
