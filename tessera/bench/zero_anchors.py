"""``tessera bench zero``, the anchors: torch FSDP2 and DeepSpeed ZeRO built on each rank as their
users build them (see :mod:`tessera.bench.zero` for how they are measured)."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from tessera.bench.zero_sides import LossFn, Side, StepFn, Workload, model_of


def prepare(side: Side) -> None:
    """Imports and one-time setup of ``side`` (kept out of its memory measurement)."""
    if side.system == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401
    elif side.system == "deepspeed":
        _deepspeed(load_cpu_adam=side.offload)


_cpu_adam: dict[str, bool] = {}


def _deepspeed(load_cpu_adam: bool = False) -> Any:
    """DeepSpeed on its CPU accelerator, joined to the process group that is already running."""
    import torch.distributed as dist

    os.environ["DS_ACCELERATOR"] = "cpu"  # its CPU accelerator; gloo is its comm backend there
    # DeepSpeed's engine asks the launcher's variables; the pool is one node
    for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()),
                       ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_SIZE", dist.get_world_size())):  # fmt: skip
        os.environ[key] = str(value)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing default group
    if load_cpu_adam and "ok" not in _cpu_adam:
        try:  # a JIT-compiled C++ op (ninja, a C++ compiler); built once into the torch extensions cache
            from deepspeed.ops.op_builder import CPUAdamBuilder

            CPUAdamBuilder().load()
            _cpu_adam["ok"] = True
        except Exception as exc:
            logger.warning(f"DeepSpeedCPUAdam cannot be built here ({exc}); ZeRO-Offload steps torch AdamW")
            _cpu_adam["ok"] = False
    return deepspeed


def build_fsdp2(side: Side, w: Workload) -> tuple[StepFn, LossFn, str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tessera.models import NextTokenLoss

    model = model_of(w)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if w.dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = side.stage == 3
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
    criterion = NextTokenLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(criterion(model(x), y).float())

    return step, loss, side.label


def build_deepspeed(side: Side, w: Workload, world: int) -> tuple[StepFn, LossFn, str]:
    deepspeed = _deepspeed(load_cpu_adam=side.offload)
    model = model_of(w)
    zero: dict[str, Any] = {"stage": side.stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": w.micro_batch * world,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as on the other sides
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told; the other sides do not clip
        "bf16": {"enabled": w.dtype == "bf16"},
        "steps_per_print": 2**31 - 1,
    }
    label = side.label
    if side.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if side.offload and _cpu_adam.get("ok"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(
            model.parameters(), lr=w.lr, weight_decay=0.01, adamw_mode=True
        )
        label += " (DeepSpeedCPUAdam)"
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
        if side.offload:
            config["zero_force_ds_cpu_optimizer"] = False
            label += " (torch AdamW)"
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    step, loss = deepspeed_step_and_loss(engine)
    return step, loss, label


def deepspeed_step_and_loss(engine: Any) -> tuple[StepFn, LossFn]:
    """A training step and the loss of a batch, through a DeepSpeed engine of the GPT."""
    from tessera.models import NextTokenLoss

    criterion = NextTokenLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(criterion(engine(x), y))
        engine.step()

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(criterion(engine(x), y).float())

    return step, loss
