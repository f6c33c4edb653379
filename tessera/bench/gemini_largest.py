"""``tessera bench gemini``, the largest GPT each system trains under one memory budget.

Every system trains GPTs of width ``d_model`` and a growing number of blocks, one size at a time,
each in a fresh pool of 2 ranks (warmed up on a miniature model first, as the other rows): the
user code builds the model (tessera deferred, as ``tessera train`` does; DeepSpeed whole, as its
users do without ``zero.Init``), the system sets up and trains 2 steps of one micro-batch
``[1, seq_len]`` per rank. A size fits when it trains and the peak RSS above the baseline stays
within the budget on every rank. Gemini is given the budget as its settings: ``static`` with
every chunk homed off the device, a device budget of an eighth (gathered chunks, buckets), a host
budget of a third, the rest of model state on disk (the remainder is for activations and the
runtime). DeepSpeed runs ZeRO-3 with CPU offload and with NVMe offload; its
better one is the anchor. The sizes grow until one does not fit (or ``max_layers``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20


@dataclass(frozen=True)
class Largest:
    """The search: memory ``budget`` bytes per rank above the baseline, GPT blocks of width
    ``d_model``, ``layers`` tried in order."""

    budget: int = 768 * _MIB
    d_model: int = 512
    seq_len: int = 64
    layers: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
    steps: int = 2

    def model(self, n_layers: int) -> torch.nn.Module:
        from tessera.models import gpt

        torch.manual_seed(0)
        heads = 8 if self.d_model % 8 == 0 else 1
        return gpt("small", max_seq_len=self.seq_len, d_model=self.d_model, n_layers=n_layers, n_heads=heads)


def _batches(search: Largest, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2000 + rank)
    tokens = [torch.randint(0, 256, (1, search.seq_len + 1), generator=g) for _ in range(search.steps)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _build(system: str, search: Largest, n_layers: int, folder: str) -> tuple[Any, Any]:
    """A step function and a closer for ``system`` ("tessera", "deepspeed-cpu", "deepspeed-nvme")."""
    from tessera.models import NextTokenLoss

    if system == "tessera":
        import tessera
        from tessera.testing import use_layout

        gemini = {"placement": "static", "params_offload": 1.0, "optimizer_offload": 1.0,
                  "device_budget": search.budget // 8, "host_budget": search.budget // 3, "offload_dir": folder}  # fmt: skip
        use_layout(config={"gemini": gemini})
        with tessera.deferred_init():
            model = search.model(n_layers)
        engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
        return (lambda x, y: engine.train_batch(iter([(x, y)]))), engine.strategy.close
    from tessera.bench.gemini_common import deepspeed_offload

    step, _ = deepspeed_offload(search.model(n_layers), system.split("-")[1], folder, micro_batch=1, lr=1e-3)
    return step, lambda: None


def fits_body(system: str, search: Largest, n_layers: int) -> int | None:
    """This rank's peak RSS above its baseline while ``system`` builds and trains the GPT of
    ``n_layers`` blocks (None: it failed)."""
    from tessera.bench.gemini_common import peak_growth
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    with tempfile.TemporaryDirectory() as folder:
        try:
            return peak_growth(
                lambda: _build(system, dataclasses.replace(search, d_model=16), 1, f"{folder}/warm"),
                lambda: _build(system, search, n_layers, f"{folder}/run"),
                _batches(search, world.rank),
            )
        except Exception:  # does not train at this size (a budget error, an allocation failure)
            return None


def largest(
    system: str, search: Largest, world: int = 2, pools: PoolSet | None = None
) -> tuple[int, dict[int, int | None]]:
    """The parameters of the largest GPT ``system`` trains within the budget, and the peak
    growth measured at each size tried: each size on a fresh pool, or on ``pools``'
    (:func:`~tessera.bench.pools.rank_pool`)."""
    best, seen = 0, {}
    for n_layers in search.layers:
        with rank_pool(world, pools) as pool:
            try:
                grown = pool.run(fits_body, system, search, n_layers, timeout=1800)
            except Exception:  # a rank died (the system ran out of memory): too large
                grown = [None]
        peak = None if any(g is None for g in grown) else max(g for g in grown if g is not None)
        seen[n_layers] = peak
        if peak is None or peak > search.budget:
            break
        with torch.device("meta"):
            best = sum(p.numel() for p in search.model(n_layers).parameters())
    return best, seen


def largest_rows(search: Largest, with_deepspeed: bool, nvme: bool) -> tuple[list[Row], dict[str, Any]]:
    """The row "largest gpt under <budget>": tessera's largest against DeepSpeed's better one."""
    found: dict[str, Any] = {"tessera": largest("tessera", search)}
    if with_deepspeed:
        found["deepspeed-cpu"] = largest("deepspeed-cpu", search)
        if nvme:
            found["deepspeed-nvme"] = largest("deepspeed-nvme", search)
    rows: list[Row] = []
    anchors = {k: v for k, v in found.items() if k != "tessera"}
    if anchors:
        name_of, (params, _) = max(anchors.items(), key=lambda kv: kv[1][0])
        anchor = f"DeepSpeed ZeRO-3 {name_of.split('-')[1]} offload"
        rows.append(Row(f"largest gpt d{search.d_model} under {search.budget // _MIB} MiB/rank", "parameters",
                        float(found["tessera"][0]), anchor, float(max(params, 1))))  # fmt: skip
    return rows, found


__all__ = ["Largest", "largest", "largest_rows"]
