"""One short run per strategy through the public API, on the ranks of a pool.

Every run trains the same small GPT (vocabulary 64, 16 tokens, fp32 unless stated) for 8 steps
on the same fixed token sequences with AdamW, gradient clipping at 0.5 (below the gradient norms,
so the global norm and the clipping act on every step) and, where the layout has no pipeline, two
accumulation micro-batches per step (a pipeline runs 4 micro-batches instead). Dropout stays off: a
pool's cached layouts carry their RNG streams from test to test, so a run that drew random
numbers during training would depend on the tests before it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout
from tests.golden.numerics import numerics_class
from tests.golden.record import hex_floats, weights_fingerprint

STEPS = 8
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
ZERO_BUCKET_MB = 0.016  # ~4k fp32 elements a chunk: the model spreads over several chunks
DATASET = "(start + stride * arange(17)) % 64, start in [0, 64) and stride in [1, 4) drawn with Generator seed 7"


@dataclasses.dataclass(frozen=True)
class GoldenRun:
    """A layout and its training settings; ``ranks`` is the pool's world size."""

    ranks: int
    data: int = 1
    tensor: int = 1
    mode: str = "1d"
    depth: int = 1
    sequence_parallel: bool = False
    pipeline: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    zero_stage: int = 0
    offload: str = "none"
    dtype: str = "fp32"
    accumulation: int = 2
    clip: float = 0.5  # below the gradient norms of these runs: every step is clipped
    # added with the runs of Gemini, sequence and expert parallelism and recomputation; recorded
    # in a run's definition only where they differ from these defaults (older files stay valid)
    sequence: int = 1
    sequence_mode: str = "ring_qk"
    expert: int = 1  # > 1: the MoE GPT, its experts over this many ranks
    gemini: str = ""  # "", or one of GEMINI's placements
    recompute: str = "none"
    compile: str = ""  # "", or the torch.compile backend of a compiled run (its blocks compiled)

    def config(self, offload_dir: str | None = None) -> dict[str, Any]:
        pipeline = {"size": self.pipeline, "schedule": self.schedule, "microbatches": self.microbatches,
                    "chunks": self.chunks}  # fmt: skip
        tensor = {"size": self.tensor, "mode": self.mode, "depth": self.depth,
                  "sequence_parallel": self.sequence_parallel}  # fmt: skip
        config: dict[str, Any] = {
            "parallel": {
                "data": self.data,
                "pipeline": pipeline,
                "tensor": tensor,
                "expert": self.expert,
                "sequence": {"size": self.sequence, "mode": self.sequence_mode},
            },
            "zero": {"stage": self.zero_stage, "chunk_mb": ZERO_BUCKET_MB, "offload_optimizer": self.offload},
            "mixed_precision": {"dtype": self.dtype},
            "gradient_accumulation": self.accumulation,
            "clip_grad_norm": self.clip,
            "activation_checkpoint": {"mode": self.recompute},
        }
        if self.compile:
            config["compile"] = {"enabled": True, "backend": self.compile}
        if self.gemini:
            disk = GEMINI[self.gemini].get("offload_dir", False)
            config["gemini"] = {**GEMINI[self.gemini], "offload_dir": offload_dir if disk else None}
        return config

    def model(self) -> dict[str, Any]:
        """The GPT's preset and settings (the MoE preset where experts are spread)."""
        base = {"vocab_size": VOCAB, "max_seq_len": SEQ, "d_model": 32, "n_layers": 2, "n_heads": 4}
        if self.expert > 1:
            return {"preset": "tiny-moe", **base, "d_ff": 32, "num_experts": 4}
        return {"preset": "tiny", **base}

    def micro_batch(self) -> int:
        per_step = self.microbatches if self.pipeline > 1 else self.accumulation
        return GLOBAL_BATCH // (self.data * per_step)

    def definition(self) -> dict[str, Any]:
        """What the golden file records about the run (a change to it means regenerating)."""
        fields = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in LATER_FIELDS and fields[f.name] == f.default:
                del fields[f.name]
        if self.gemini:
            fields["gemini"] = {"placement": self.gemini, **GEMINI[self.gemini]}
        return {**fields, "steps": STEPS, "global_batch": GLOBAL_BATCH, "model": self.model(),
                "optimizer": "AdamW(lr=3e-3, eps=1e-6)", "dataset": DATASET}  # fmt: skip


LATER_FIELDS = {"sequence", "sequence_mode", "expert", "gemini", "recompute", "compile"}
# Gemini's placements: every part on the device; the auto policy with a device budget that sends
# parts to host memory; and with a host budget too, through the disk tier
GEMINI: dict[str, dict[str, Any]] = {
    "static-device": {
        "placement": "static",
        "params_offload": 0.0,
        "optimizer_offload": 0.0,
        "chunk_mb": ZERO_BUCKET_MB,
    },
    "auto-host": {"placement": "auto", "device_budget": 150_000, "chunk_mb": ZERO_BUCKET_MB},
    # for two ranks of two-sample micro-batches (the compiled runs): room for their activations
    "auto-host-2x": {"placement": "auto", "device_budget": 400_000, "chunk_mb": ZERO_BUCKET_MB},
    "auto-disk": {
        "placement": "auto",
        "device_budget": 150_000,
        "host_budget": 40_000,
        "chunk_mb": ZERO_BUCKET_MB,
        "offload_dir": True,
    },
}


PP = dict(ranks=4, accumulation=1, microbatches=4)
RUNS: dict[str, GoldenRun] = {
    "dp4": GoldenRun(4, data=4),
    "tp1d-tp2-dp2": GoldenRun(4, data=2, tensor=2),
    "tp1d-tp2-sp-dp2": GoldenRun(4, data=2, tensor=2, sequence_parallel=True),
    "tp2d-tp4": GoldenRun(4, tensor=4, mode="2d"),
    "tp2.5d-tp8-depth2": GoldenRun(8, tensor=8, mode="2.5d", depth=2),
    "tp3d-tp8": GoldenRun(8, tensor=8, mode="3d"),
    "pp2-gpipe-dp2": GoldenRun(**PP, data=2, pipeline=2, schedule="gpipe"),
    "pp4-1f1b": GoldenRun(**PP, pipeline=4, schedule="1f1b"),
    "pp2-interleaved-v2-dp2": GoldenRun(**PP, data=2, pipeline=2, schedule="interleaved", chunks=2),
    "pp4-zero-bubble": GoldenRun(**PP, pipeline=4, schedule="zero_bubble"),
    "zero1-dp4": GoldenRun(4, data=4, zero_stage=1),
    "zero2-dp4": GoldenRun(4, data=4, zero_stage=2),
    "zero3-dp4": GoldenRun(4, data=4, zero_stage=3),
    "zero2-offload-dp4": GoldenRun(4, data=4, zero_stage=2, offload="cpu"),
    "bf16-tp2-dp2": GoldenRun(4, data=2, tensor=2, dtype="bf16"),
    "gemini-static-device-dp4": GoldenRun(4, data=4, gemini="static-device"),
    "gemini-auto-host-dp4": GoldenRun(4, data=4, gemini="auto-host"),
    "gemini-auto-disk-dp4": GoldenRun(4, data=4, gemini="auto-disk"),
    "sp2-ring_qk-dp2": GoldenRun(4, data=2, sequence=2, sequence_mode="ring_qk"),
    "sp2-ring-dp2": GoldenRun(4, data=2, sequence=2, sequence_mode="ring"),
    "sp2-all_to_all-dp2": GoldenRun(4, data=2, sequence=2, sequence_mode="all_to_all"),
    "ep2-dp4": GoldenRun(4, data=4, expert=2),
    "recompute-full-dp4": GoldenRun(4, data=4, recompute="full"),
    "recompute-selective-dp4": GoldenRun(4, data=4, recompute="selective"),
    # compiled blocks beside their eager runs (dp4, tp1d-tp2-dp2): the captured graphs run by torch's
    # own kernels, whose numerics the classes pin (inductor's generated kernels follow the CPU)
    "dp4-compiled": GoldenRun(4, data=4, compile="aot_eager"),
    "tp1d-tp2-dp2-compiled": GoldenRun(4, data=2, tensor=2, compile="aot_eager"),
}


def dataset() -> TensorDataset:
    """Learnable sequences (so the loss falls): each sample counts up by a fixed stride."""
    g = torch.Generator().manual_seed(7)
    n = GLOBAL_BATCH * STEPS
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def start(run: GoldenRun, offload: str) -> tuple[Any, torch.nn.Module, DataLoader]:
    """``run``'s layout on this rank, and its engine, model (GPT, seed 0) and data loader."""
    use_layout(data=run.data, pipeline=run.pipeline, tensor=run.tensor, mode=run.mode, depth=run.depth,
               sequence=run.sequence, expert=run.expert, config=run.config(offload))  # fmt: skip
    torch.manual_seed(0)
    model = gpt(**run.model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(dataset(), batch_size=run.micro_batch())
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    assert loader is not None
    return engine, model, loader


def train_golden(name: str) -> tuple[str, dict[str, Any]]:
    """Run ``RUNS[name]`` on every rank of the pool; every rank returns its numerics class and
    the numbers it saw."""
    run = RUNS[name]
    if run.compile:
        torch._dynamo.reset()  # a pool's ranks outlive a run: compile this one from empty caches
    with tempfile.TemporaryDirectory() as offload:
        engine, model, loader = start(run, offload)
        it = iter(loader)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(engine.train_batch(it))
            assert engine.last_grad_norm is not None, "clipping is on: the engine reports the norm"
            norms.append(engine.last_grad_norm)
        weights = weights_fingerprint(full_state_dict(model))
        engine.strategy.close()
    return numerics_class(), {"losses": hex_floats(losses), "grad_norms": hex_floats(norms), "final_weights": weights}


def compute(pools: Any, name: str) -> tuple[str, dict[str, Any]]:
    """The numerics class and the numbers of run ``name``, checked to be the same on every rank."""
    results = pools.run(RUNS[name].ranks, train_golden, name, timeout=300)
    for rank, result in enumerate(results[1:], start=1):
        assert result == results[0], f"golden run {name!r}: rank {rank} reports other numbers than rank 0"
    return results[0]
