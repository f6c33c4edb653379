"""How much compiling could win at most: one eager training step of a GPT preset on one intra-op
thread, its operators' own CPU time sorted into what compiling cannot shrink and what it can.

Compiling the blocks (``compile.enabled``) fuses elementwise work and drops Python; it does not
make the matrix products faster (inductor calls the same GEMM library on CPU) nor the fused
optimizer kernel, and it leaves the collectives as they are. This script profiles one eager
step (``torch.profiler``, after warm-up steps) and sorts each operator's self time into:

- ``gemm``: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (the products of the blocks and the head);
- ``attention``: the fused scaled-dot-product attention kernels, forward and backward;
- ``optimizer``: the fused AdamW kernel and ``zero_grad``;
- ``rest``: everything else (norms, GELU, adds, copies, fills, the loss's log-softmax, the
  embedding's backward, autograd's bookkeeping).

The ceiling of compiling is then ``step / (step - rest)``: the speed-up if compiling removed
*all* of ``rest`` (it cannot: the log-softmax, the fills of new gradients and the embedding's
backward stay), so the true figure is below it. ``--step S`` also prints the ceiling of a step of
``S`` seconds measured elsewhere with the same per-rank work (a data-parallel rank of the bench:
its extra time is the gradient all-reduce, which compiling does not touch either).

Usage: ``python benchmarks/compile_ceiling.py [--preset gpt2] [--batch 2] [--seq 128] [--step 2.564]``
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION_PREFIX = "aten::_scaled_dot_product"
OPTIMIZER = {"aten::_fused_adamw_", "aten::_fused_adam_"}


def kind(name: str) -> str:
    if name in GEMM:
        return "gemm"
    if name.startswith(ATTENTION_PREFIX):
        return "attention"
    if name in OPTIMIZER or name.startswith("Optimizer.zero_grad"):
        return "optimizer"
    return "rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (a dp2 rank's share of 4)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--step", type=float, action="append", default=[],
                        help="a step time (s) measured elsewhere with the same per-rank work")  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tessera.models import NextTokenLoss, gpt

    torch.manual_seed(0)
    model = gpt(args.preset, max_seq_len=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    criterion = NextTokenLoss()
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    shares = dict.fromkeys(("gemm", "attention", "optimizer", "rest"), 0.0)
    for event in prof.key_averages():
        shares[kind(event.key)] += event.self_cpu_time_total / 1e6
    profiled = sum(shares.values())
    median = sorted(times)[len(times) // 2]
    print(f"{args.preset}, {args.batch} x {args.seq} tokens, one thread: eager step {median:.3f} s "
          f"(profiled step {profiled:.3f} s of operator self time)")  # fmt: skip
    for name, seconds in shares.items():
        print(f"  {name:<10} {seconds:7.3f} s  {seconds / profiled:6.1%}")
    ceiling = profiled / (profiled - shares["rest"])
    print(f"ceiling of compiling (all of 'rest' removed): {ceiling:.3f}x")
    result = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "step_s": median,
              "profiled_s": profiled, "shares_s": shares, "ceiling": ceiling, "elsewhere": {}}  # fmt: skip
    for other in args.step:
        result["elsewhere"][str(other)] = other / (other - shares["rest"])
        print(f"ceiling of a {other:.3f} s step with the same work: {other / (other - shares['rest']):.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
