"""Eager vs compiled training steps of tessera's GPT on one GPU, in bf16: tokens/s and model FLOP
utilisation against the device's peak, and the cold compile time.

    PYTHONPATH=. python benchmarks/gpu_probe.py --out probe.json [--presets gpt2 gpt2-medium]

A probe for the compile issue's GPU point, run where a GPU is lent (it runs on CPU too, slowly,
with ``--device cpu --presets tiny``). One process, the engine's own step (``engine.train_batch``),
``torch.compile`` applied to each transformer block (regional compilation) or not.
FLOPs per token: ``GPT.flops_per_token``, ``6 N + 12 L d T`` (N parameters without the position
embedding's lookup, the tied token embedding counted once as the head's product, L blocks, d
width, T sequence length: the PaLM paper's count with causal attention not halved); the peak:
``tessera.engine.peak.device_peak`` (the data sheet's dense bf16 figure, or measured).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.engine.flops import mfu
from tessera.engine.peak import device_peak
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout


def run(preset: str, compiled: bool, device: torch.device, batch: int, steps: int, warmup: int) -> dict:
    use_layout(config={"mixed_precision": {"dtype": "bf16"}}, device=device)
    torch.manual_seed(0)
    model = gpt(preset)
    cfg = model.config
    seq = cfg.max_seq_len
    if compiled:
        for block in model.blocks:
            block.compile()
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(seq)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    tokens = torch.randint(0, cfg.vocab_size, (batch * (steps + warmup), seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    it = iter(loader)
    start = time.perf_counter()
    first = float(engine.train_batch(it))
    cold = time.perf_counter() - start
    for _ in range(warmup - 1):
        engine.train_batch(it)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        last = float(engine.train_batch(it))  # float() waits for the step
    seconds = (time.perf_counter() - start) / steps
    peak = device_peak(device, "bf16")
    tokens_per_s = batch * seq / seconds
    return {
        "preset": preset,
        "compiled": compiled,
        "device": peak.device,
        "peak_tflops": round(peak.flops_per_s / 1e12, 2),
        "peak_source": peak.source,
        "flops_per_token": flops_per_token,
        "params": n_params,
        "batch": batch,
        "seq": seq,
        "first_step_s": round(cold, 3),
        "step_s": round(seconds, 5),
        "tokens_per_s": round(tokens_per_s),
        "model_tflops_per_s": round(tokens_per_s * flops_per_token / 1e12, 2),
        "mfu": round(mfu(tokens_per_s, flops_per_token, 1, peak.flops_per_s), 4),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "loss_first_last": [round(first, 4), round(last, 4)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-medium"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="gpu_probe.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for preset in args.presets:
        for compiled in (False, True):
            try:
                rows.append(run(preset, compiled, device, args.batch, args.steps, args.warmup))
            except Exception as error:  # a probe: record what broke and go on with the next row
                rows.append({"preset": preset, "compiled": compiled, "error": f"{type(error).__name__}: {error}"})
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
