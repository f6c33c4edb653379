"""Cluster figures with their sources, and the planning scenarios of docs/planner.md ("At scale"):
a 70B LLaMA-shaped model on 1,024 GPUs, and the 64-GPU ViT and GPT-3 settings of the Colossal-AI
paper (Li et al., "Colossal-AI: A Unified Deep Learning System For Large-Scale Parallel
Training", arXiv:2110.14883, ICPP 2023) with the layouts reported for them beside the search's.

Figures are per device. Link bandwidths are what one rank moves while every rank moves (the bus
bandwidth NCCL's tests report), latencies the fixed cost of one collective call. Compute is the
dense matmul peak of the datasheet times :data:`UTILISATION`, a share stated here rather than
measured (``tessera plan --calibrate`` measures it on the machine at hand).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.planner.search import Baseline, Limits, Plan, default_baselines, plan
from tessera.planner.spec import Cluster, Link, ModelSpec, Workload, resolve_model, vit_spec

GIB = 2**30
#: share of the matmul peak a large transformer's step sustains (Megatron-LM reports 44-52% of the
#: A100 bf16 peak for GPT models of 1-1000B parameters; Narayanan et al. 2021, Table 1)
UTILISATION = 0.5


@dataclass(frozen=True)
class Hardware:
    """A kind of device and its links: ``peak`` FLOP/s per compute dtype, ``memory`` bytes per device
    of which ``reserve`` stay with the CUDA context, NCCL's buffers and the allocator's slack."""

    name: str
    memory: int
    peak: dict[str, float]
    intra: Link
    inter: Link
    devices_per_node: int
    source: str
    reserve: int = 2 * GIB

    def cluster(
        self,
        devices: int,
        *,
        dtype: str = "bf16",
        device_memory: int | None = None,
        devices_per_node: int | None = None,
        utilisation: float = UTILISATION,
    ) -> Cluster:
        """A cluster of ``devices`` of this kind (``device_memory``: usable bytes, default memory less reserve)."""
        per_node = devices_per_node or min(self.devices_per_node, devices)
        return Cluster(
            devices=devices,
            device_memory=device_memory or self.memory - self.reserve,
            flops=self.peak[dtype] * utilisation,
            intra=self.intra,
            inter=self.inter,
            devices_per_node=per_node,
            name=f"{devices} x {self.name}",
        )


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 datasheet: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32 (torch keeps TF32 off for
    # matmuls by default); NVLink 3 through NVSwitch, 600 GB/s per GPU both ways, of which NCCL's
    # all-reduce reaches ~230 GB/s bus bandwidth on a DGX A100; one HDR InfiniBand NIC (200 Gb/s)
    # per GPU, ~24 GB/s bus bandwidth across nodes.
    "a100-80gb": Hardware(
        "A100 80GB (DGX A100: NVLink 3 + 8x HDR InfiniBand)",
        memory=80 * GIB,
        peak={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        intra=Link(bandwidth=230e9, latency=10e-6),
        inter=Link(bandwidth=24e9, latency=20e-6),
        devices_per_node=8,
        source="NVIDIA A100 and DGX A100 datasheets; NCCL bus bandwidths",
    ),
    # H100 SXM datasheet: 989 TFLOP/s bf16 dense; NVLink 4, 900 GB/s per GPU (~360 GB/s NCCL bus
    # bandwidth); one NDR InfiniBand NIC (400 Gb/s) per GPU, ~48 GB/s.
    "h100-80gb": Hardware(
        "H100 80GB (DGX H100: NVLink 4 + 8x NDR InfiniBand)",
        memory=80 * GIB,
        peak={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        intra=Link(bandwidth=360e9, latency=8e-6),
        inter=Link(bandwidth=48e9, latency=15e-6),
        devices_per_node=8,
        source="NVIDIA H100 and DGX H100 datasheets; NCCL bus bandwidths",
    ),
    # A CPU rank of one thread under gloo on loopback (this project's test machines): rough
    # figures for ranking only; `tessera plan --calibrate` measures them.
    "cpu": Hardware(
        "CPU rank (1 thread, gloo over loopback)",
        memory=4 * GIB,
        peak={"bf16": 2e10, "fp16": 2e10, "fp32": 4e10},
        intra=Link(bandwidth=2e9, latency=50e-6),
        inter=Link(bandwidth=1e9, latency=100e-6),
        devices_per_node=64,
        source="rough figures of one-thread CPU ranks",
        reserve=0,
    ),
}
HARDWARE["a100-40gb"] = dataclasses.replace(
    HARDWARE["a100-80gb"], name="A100 40GB (DGX A100: NVLink 3 + 8x HDR InfiniBand)", memory=40 * GIB
)


@dataclass(frozen=True)
class Scenario:
    """A planning problem with its sources: the model, the cluster, the step, and the layouts shown
    beside the search's best (the default baselines and, for a paper's setting, what it reported)."""

    name: str
    title: str
    model: Callable[[], ModelSpec]
    cluster: Cluster
    workload: Workload
    reported: tuple[Baseline, ...] = ()
    sources: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)

    def run(self, top: int = 8) -> Plan:
        model = self.model()
        baselines = [*default_baselines(model, self.cluster), *self.reported]
        return plan(model, self.cluster, self.workload, top=top, limits=self.limits, baselines=baselines)


def _reported(name: str, **pins: object) -> Baseline:
    return Baseline(name, dict(pins), reported=True)


def colossal_vit() -> ModelSpec:
    """The ViT of the 64-GPU tensor-parallel setting: 64 heads so that every mode runs at size 64
    (1d needs the heads to split 64 ways), 32 layers of width 4096, 224-pixel images in 14-pixel
    patches (256 patches and the class token), 1,000 classes."""
    return vit_spec("vit:colossal-64", n_layers=32, d_model=4096, n_heads=64, ff_dim=4 * 4096, patches=256,
                    patch_dim=3 * 14 * 14, num_classes=1000)  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    "llama70b-1024": Scenario(
        "llama70b-1024",
        "LLaMA-2 70B shape on 1,024 A100 80GB (128 DGX nodes), 4M-token steps",
        lambda: resolve_model("llama:70b"),
        HARDWARE["a100-80gb"].cluster(1024, dtype="bf16"),
        # LLaMA 2 (Touvron et al. 2023, section 2.2): 4M-token batches of 4,096 tokens, AdamW, bf16
        Workload(global_batch=1024, seq_len=4096, dtype="bf16", optimizer="adamw"),
        sources=("Touvron et al. 2023 (LLaMA 2), section 2.2 and Table 1", "HARDWARE['a100-80gb']"),
    ),
    "colossal-vit-64": Scenario(
        "colossal-vit-64",
        "Colossal-AI's 64-GPU ViT setting: tensor parallelism of size 64 in each mode",
        colossal_vit,
        HARDWARE["a100-80gb"].cluster(64, dtype="fp16"),
        Workload(global_batch=512, dtype="fp16", optimizer="adamw"),
        reported=(
            _reported("paper: 1D tp64", tensor=64, tensor_mode="1d", sequence_parallel=False, pipeline=1, data=1),
            _reported("paper: 2D tp64", tensor=64, tensor_mode="2d", pipeline=1, data=1),
            _reported("paper: 2.5D tp64 d4", tensor=64, tensor_mode="2.5d", depth=4, pipeline=1, data=1),
            _reported("paper: 3D tp64", tensor=64, tensor_mode="3d", pipeline=1, data=1),
        ),
        sources=(
            "Colossal-AI README: ViT, 'tensor parallelism = 64' (14x larger batch, 5x faster than 1D)",
            "arXiv:2110.14883, section 5 (multi-dimensional tensor parallelism on ViT)",
        ),
    ),
    "colossal-gpt3-64": Scenario(
        "colossal-gpt3-64",
        "Colossal-AI's GPT-3 175B setting on 64 A100 80GB, global batch 192 x 2,048 tokens",
        lambda: resolve_model("gpt3:175b"),
        HARDWARE["a100-80gb"].cluster(64, dtype="fp16"),
        # global batch 192 (hpcaitech/ColossalAI issue #1414); sequence 2,048 (its GPT-3 config)
        Workload(global_batch=192, seq_len=2048, dtype="fp16", optimizer="adamw"),
        reported=(
            # examples/language/gpt/titans/configs/gpt3_zero3_pp1d.py: ZeRO-3, 1D tensor parallelism
            # of a node's GPUs, activation checkpointing
            _reported(
                "Colossal-AI: ZeRO-3 + 1D tp8",
                tensor=8,
                tensor_mode="1d",
                pipeline=1,
                sequence=1,
                zero=3,
                checkpoint="full",
            ),
            # Megatron-LM's 175B recipe (Narayanan et al. 2021): 1D tp8 within a node, pipeline across
            _reported("Megatron-LM: tp8 pp8", tensor=8, tensor_mode="1d", pipeline=8, sequence=1, data=1),
        ),
        sources=(
            "hpcaitech/ColossalAI issue #1414 (GPT-3 benchmark: global batch 192)",
            "hpcaitech/ColossalAI examples/language/gpt/titans/configs/gpt3_zero3_pp1d.py",
            "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters",
        ),
    ),
}
