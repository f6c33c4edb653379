"""``tessera bench gemini``, what its rows share: DeepSpeed ZeRO-3 with offload as its users
set it up, and the peak-memory measurement after a warm-up (see :mod:`tessera.bench.gemini`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from tessera.bench.zero_sides import LossFn, StepFn


def deepspeed_offload(
    model: torch.nn.Module, offload: str, folder: str, micro_batch: int, lr: float
) -> tuple[StepFn, LossFn]:
    """``model`` under DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to
    ``offload`` ("cpu", or "nvme" in ``folder``), stepped by ``DeepSpeedCPUAdam``: a training
    step and the loss of a batch."""
    from tessera.bench.zero_anchors import _deepspeed, deepspeed_step_and_loss

    deepspeed = _deepspeed(load_cpu_adam=True)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    world = torch.distributed.get_world_size()
    where: dict[str, Any] = {"device": offload, "pin_memory": False}
    if offload == "nvme":
        where["nvme_path"] = folder
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "zero_optimization": {"stage": 3, "offload_param": dict(where), "offload_optimizer": dict(where)},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    if offload == "nvme":
        config["aio"] = {"block_size": 2**20, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=lr, weight_decay=0.01, adamw_mode=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return deepspeed_step_and_loss(engine)


def peak_growth(
    build_warm: Callable[[], tuple[StepFn, Callable[[], None]]],
    build_run: Callable[[], tuple[StepFn, Callable[[], None]]],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> int | None:
    """Peak RSS above the baseline while ``build_run()`` sets up and trains on ``batches``, after
    the same code paths ran once through ``build_warm()`` (imports and one-time set-up stay
    outside the measurement; its freed memory is collected and trimmed first). None where the
    peak cannot be read. Errors of ``build_run`` propagate."""
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap

    step, close = build_warm()
    for x, y in batches:
        step(x, y)
    close()
    del step
    gc.collect()
    trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()
    step, close = build_run()
    for x, y in batches:
        step(x, y)
    peak = peak_rss_bytes()
    close()
    return None if base is None or peak is None else peak - base


__all__ = ["deepspeed_offload", "peak_growth"]
