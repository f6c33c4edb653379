"""The ``tessera`` command: run, train, plan, check, bench, ckpt, serve, generate, rlhf.

Importing this module does not import torch: ``--help`` and ``--version`` answer at once, and
``train`` checks its config and layout before torch is loaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

from tessera.cli import ckpt
from tessera.cli import plan as planning
from tessera.cli import rlhf as alignment
from tessera.cli import serve as serving
from tessera.errors import TesseraError


def _smoke_all_reduce() -> float:
    import torch

    from tessera import comm, get_context

    ctx = get_context()
    t = torch.full((4,), float(ctx.rank + 1))
    comm.all_reduce(t, "world")
    return float(t[0])


def _peak_lines() -> list[str]:
    """One rank's peak, the denominator of the trainer's MFU: a CPU rank's fp32 matmul rate at a
    rank's default intra-op threads (measured once, then read from the cache), and the first
    GPU's bf16 peak (its data sheet's, or measured)."""
    import torch

    from tessera.config import LaunchConfig
    from tessera.engine.peak import cache_file, device_peak

    threads, rank_threads = torch.get_num_threads(), LaunchConfig().intra_op_threads or torch.get_num_threads()
    torch.set_num_threads(rank_threads)
    try:
        cpu = device_peak("cpu", "fp32")
    finally:
        torch.set_num_threads(threads)
    lines = [f"peak        cpu rank: {cpu.describe()}, kept in {cache_file()}"]
    if torch.cuda.is_available():
        lines.append(f"peak        cuda:0: {device_peak('cuda:0', 'bf16').describe()}")
    return lines


def _compile_lines() -> list[str]:
    """Compile a small GPT's blocks twice (the second from the compile cache) and report."""
    from tessera.compiling.probe import probe_compile
    from tessera.errors import ToolchainError

    try:
        result = probe_compile()
    except ToolchainError as exc:
        return [f"compile     not available: {exc}"]
    return [
        f"compile     inductor, 4 MLP blocks: cold {result.cold_s:.1f} s, warm {result.warm_s:.1f} s "
        f"(from the compile cache: {result.cache_hits} graph(s)); compiled = eager within {result.max_diff:.1e}",
        *(f"            {line}" for line in result.report.lines()),
    ]


def _cmd_check(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from tessera import __version__

    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    print(f"tessera     {__version__}")
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__}")
    print(f"backends    {', '.join(backends) or 'none'}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"devices     cuda x{len(names)}: {', '.join(names)}")
    else:
        print("devices     cpu only (no CUDA device visible)")
    print(f"cpus        {os.cpu_count()}")
    for line in _peak_lines():
        print(line)
    if args.compile:
        for line in _compile_lines():
            print(line)
    from tessera.testing import RankPool

    pool = RankPool(2)
    try:
        sums = pool.run(_smoke_all_reduce, timeout=60)
    finally:
        pool.close()
    ok = sums == [3.0, 3.0]
    print(f"all-reduce  2 ranks (gloo): {'ok' if ok else f'WRONG: {sums}'}")
    return 0 if ok else 1


BENCH_TARGETS: dict[str, str] = {  # name -> "module:function"; each strategy adds its own
    "dp": "tessera.bench.dp:main",
    "tp": "tessera.bench.tp:main",
    "pp": "tessera.bench.pp:main",
    "zero": "tessera.bench.zero:main",
    "ckpt": "tessera.bench.ckpt:main",
    "init": "tessera.bench.init:main",
    "gemini": "tessera.bench.gemini:main",
    "sp": "tessera.bench.sp:main",
    "recompute": "tessera.bench.recompute:main",
    "hf": "tessera.bench.hf:main",
    "serve": "tessera.bench.serve:main",
    "plan": "tessera.bench.plan:main",
    "moe": "tessera.bench.moe:main",
    "rlhf-generate": "tessera.bench.rlhf_generate:main",
    "lora": "tessera.bench.lora:main",
    "compile": "tessera.bench.compiled:main",
    "hosts": "tessera.bench.hosts:main",
    "diffusion": "tessera.bench.diffusion:main",
}

# name -> what it measures, how long it takes on 2 CPU cores, what it needs
BENCH_HELP: dict[str, str] = {
    "dp": "data parallel vs torch DDP, 4 ranks, GPT tiny (about 40 s)",
    "tp": "1D/2D/2.5D/3D tensor parallel vs torch parallelize_module, 4 and 8 ranks (about 50 s; "
    "--tokens 128,1024,4096,16384: about 35 min)",
    "pp": "GPipe, 1F1B, interleaved, zero-bubble vs torch.distributed.pipelining, 2 and 4 ranks (about 1 min)",
    "zero": "ZeRO 1-3 and offload vs torch FSDP2 and DeepSpeed, 4 ranks (about 4-5 min); the DeepSpeed rows "
    "need the bench extra: pip install -e '.[bench]'",
    "ckpt": "sharded checkpoint save/load vs torch.distributed.checkpoint, and the async save's stall, "
    "4 ranks (the stall: one rank per core), DDP and ZeRO-3 (about 1 min)",
    "init": "start-up peak memory and time of GPT-2 medium (355M) under deferred init vs a whole build, "
    "FSDP2 meta-device init and DeepSpeed zero.Init, 4 ranks, ZeRO-3 dp4, 1d tp4, pp4 (about 5 min)",
    "gemini": "Gemini vs DeepSpeed ZeRO-3 with CPU and NVMe offload, 2 ranks, GPT small; and a GPT of 4x the "
    "host budget trained within it through the disk tier, 1 rank (about 2 min), and the largest GPT each trains under 768 MiB per rank (about 6 min); the DeepSpeed rows need the "
    "bench extra, the NVMe row also libaio (apt install libaio-dev)",
    "sp": "the longest GPT sequence that trains under 96 MiB per rank with each sequence-parallel mode on 1, 2 "
    "and 4 ranks against 1D tensor parallelism with sequence-parallel regions; ring attention's forward against "
    "torch context_parallel, 2 ranks (about 10 min)",
    "recompute": "activation checkpointing (full, selective) of GPT small: bytes kept for the backward and step "
    "time against none, 1 process (about 1 min)",
    "hf": "an unmodified transformers LLaMA under 1D tp4 vs torch parallelize_module and DeepSpeed AutoTP, "
    "4 ranks: step time, tokens/s and the loss trajectories (about 1.5 min); needs the hf extra, the DeepSpeed rows "
    "the bench extra",
    "serve": "generation: greedy tokens/s of tessera's engine vs HF generate on the same LLaMA at batch 1 and 16, "
    "and time to first token of the OpenAI server under 8 concurrent streaming clients, 1 process and 1 rank "
    "(about 20 s); --workload: the server under Poisson arrivals of long-tailed prompts and outputs, half with a "
    "shared system prompt, vs HF generate in static batches and transformers' continuous batching at 2, 8 and 24 "
    "requests/s: tokens/s, time to first token and per output token (about 3 min; --rates, --requests, "
    "--set KEY=VALUE); needs the hf and serve extras and httpx",
    "plan": "the planner's predicted peak memory and step time against measurement for 24 layouts of GPT small, "
    "2, 4 and 8 ranks (about 10 min; --calibrate ranks the step times, about 2 min more); --scenarios: how long "
    "planning the At-scale scenarios takes, against the 10 s bar and one estimate (about 2 min)",
    "moe": "the MoE GPT (tiny-moe) under expert parallelism (ep1 and ep2 on 2 ranks, ep2 on 4) vs a dense GPT of "
    "the same active parameters and DeepSpeed-MoE: step time, tokens/s, parameters, losses (about 2 min); the "
    "DeepSpeed rows need the bench extra",
    "lora": "LoRA fine-tuning of a LLaMA-shaped model on 2 ranks: full fine-tuning vs LoRA on fp32, int8 and NF4 "
    "bases vs PEFT under DDP and DeepSpeed ZeRO-3: step time, peak RSS, trainable parameters; the largest model "
    "full fine-tuning, LoRA on NF4 and LoRA on NF4 with the base on disk under Gemini train under 768 MiB per "
    "rank (about 20 min); needs the hf and peft extras, "
    "the DeepSpeed rows the bench extra",
    "compile": "eager vs compiled training (each block compiled by inductor) of GPT-2 small and medium under dp2, "
    "ZeRO-3 dp2, 1d tp2, pp2 1F1B and ring sp2, 2 ranks: tokens/s, MFU, cold and warm compile times; tessera's "
    "compiled ZeRO-3 vs torch FSDP2 with each block compiled (about 20 min; --only gpt2 or --only dp2,zero3-dp2 "
    "runs part)",
    "hosts": "dp4 vs ZeRO-3 vs hybrid sharding (zero.shard='host') on 2 namespace hosts x 2 ranks with the link "
    "between hosts limited to 100mbit: step time, bytes across hosts, and the planner's predicted step time "
    "beside each (about 3 min; needs root for the network namespaces)",
    "diffusion": "a diffusers UNet (under a frozen CLIP text encoder and VAE) under plain torch DDP, ZeRO-3 and "
    "Gemini (model state beyond small budgets on disk), each with and without activation checkpointing, 4 ranks: "
    "peak RSS and step time; the widest UNet plain DDP and the leanest side train under 384 MiB per rank; the "
    "video diffusion transformer's longest clip at sp1, sp2 and sp4 (about 20 min); needs the diffusion extra",
    "rlhf-generate": "RLHF rollouts with the paged KV cache vs the full forward per token on the same training GPT "
    "(tiny, 16+128 tokens, batch 1 and 16), and inside whole PPO steps at batch 16: tokens/s, PPO steps/s, the same "
    "greedy tokens, 1 process (about 1 min)",
}


def _cmd_train(args: argparse.Namespace) -> int:
    from tessera.cli.launching import cmd_train

    return cmd_train(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from tessera.errors import ConfigError, NotAvailableError

    if args.target not in BENCH_TARGETS:
        known = ", ".join(sorted(BENCH_TARGETS)) or "none yet"
        raise NotAvailableError(f"no benchmark named {args.target!r}; available: {known}")
    if getattr(args, "tokens", None) is not None and args.target != "tp":
        raise ConfigError(f"--tokens applies to `tessera bench tp` only, not {args.target!r}")
    for flag in ("calibrate", "scenarios"):
        if getattr(args, flag, None) and args.target != "plan":
            raise ConfigError(f"--{flag} applies to `tessera bench plan` only, not {args.target!r}")
    if getattr(args, "only", None) and args.target not in ("plan", "lora", "compile"):
        raise ConfigError(
            f"--only applies to `tessera bench plan`, `tessera bench lora` and `tessera bench compile` only, "
            f"not {args.target!r}"
        )
    workload_flags = [
        f"--{flag}" for flag in ("rates", "requests", "set") if getattr(args, flag, None) not in (None, [])
    ]
    if (getattr(args, "workload", False) or workload_flags) and args.target != "serve":
        raise ConfigError(f"--workload and its flags apply to `tessera bench serve` only, not {args.target!r}")
    if workload_flags and not getattr(args, "workload", False):
        raise ConfigError(f"{', '.join(workload_flags)} set the workload of `tessera bench serve --workload`")
    print(f"tessera bench {args.target}: {BENCH_HELP[args.target]}", file=sys.stderr, flush=True)
    target = "tessera.bench.serve_load:main" if getattr(args, "workload", False) else BENCH_TARGETS[args.target]
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Train models too large or too slow for one device: data, tensor, pipeline, "
        "sequence parallelism and ZeRO, configured from a file.",
    )
    parser.add_argument("--version", action="version", version=f"tessera {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{run,train,plan,check,bench,ckpt,serve,generate,rlhf}")
    sub.required = True

    sub.add_parser(
        "run",
        help="launch a script on several processes (torchrun underneath): tessera run --nproc-per-node N script.py",
        add_help=False,
    )

    train = sub.add_parser("train", help="train a model from a config (default: the tiny GPT on 4 processes)")
    train.add_argument("config", nargs="?", default=None, help="config file (.py, .yaml, .toml, .json)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set parallel.data=2",
    )
    train.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc_per_node",
        type=int,
        default=None,
        metavar="N",
        help="processes on this node (default: launch.nproc_per_node, 4)",
    )
    train.add_argument(
        "--model",
        default=None,
        metavar="gpt|hf:PATH",
        help="the model (model.name): gpt, the reference GPT (default), or hf:PATH, a Hugging Face causal LM to "
        "fine-tune from a local folder (config.json and safetensors weights), or to train from random weights of "
        "a config.json; its folder's tokenizer, if any, tokenizes the text; the result goes to <run folder>/hf",
    )
    train.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="PATH",
        help="train on this text file or folder of them instead of the Python sources (data.name=text_files, "
        "data.files); repeatable",
    )
    train.add_argument("--output-dir", default=None, help="the run folder (default: trainer.output_dir/<time>-<model>)")
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH|latest",
        help="continue a run from a checkpoint: a checkpoint folder, a run folder (its newest checkpoint) or "
        "'latest' (the newest under trainer.output_dir; the default with no value); the run goes on in that "
        "checkpoint's run folder",
    )
    hosts = train.add_argument_group(
        "across hosts", 'run the same command on every host (torchrun\'s options; docs/launch.md, "Several hosts")'
    )
    hosts.add_argument("--nnodes", default=None, metavar="N", help="hosts in the job (default 1)")
    hosts.add_argument("--node-rank", type=int, default=None, metavar="K", help="this host's place, 0..N-1 (static)")
    hosts.add_argument("--master-addr", default=None, metavar="HOST", help="host 0's address (static)")
    hosts.add_argument("--master-port", type=int, default=None, metavar="PORT", help="host 0's port (static)")
    hosts.add_argument("--rdzv-backend", default=None, metavar="c10d", help="dynamic rendezvous backend")
    hosts.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the rendezvous (dynamic)")
    hosts.add_argument("--rdzv-id", default=None, metavar="ID", help="the job's id, the same on every host")
    hosts.add_argument("--rdzv-conf", default=None, metavar="K=V,...", help="rendezvous settings (last_call_timeout=2)")
    hosts.add_argument(
        "--max-restarts", type=int, default=None, metavar="N",
        help="restart the ranks up to N times after a failure (with --nnodes MIN:MAX, on the hosts left); "
        "with trainer.resume=auto they continue from the newest checkpoint",
    )  # fmt: skip
    train.set_defaults(func=_cmd_train)
    planning.add_parser(sub)

    check = sub.add_parser("check", help="print the environment and run a 2-rank all-reduce")
    check.add_argument(
        "--compile",
        action="store_true",
        help="also compile a small GPT's blocks (inductor) and report graphs, graph breaks, recompilations "
        "and the cold and warm (compile cache) compile times",
    )
    check.set_defaults(func=_cmd_check)

    targets = "\n".join(f"  {name:6} {text}" for name, text in BENCH_HELP.items())
    bench = sub.add_parser(
        "bench",
        help="benchmarks against the anchor systems, measured in the same run",
        description="Each benchmark runs tessera and its anchor in the same rank pool, alternating "
        "blocks of steps, and prints ratio = tessera / anchor (docs/benchmarks.md).",
        epilog="targets:\n" + targets,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("target", choices=sorted(BENCH_TARGETS), help="what to measure: %(choices)s (below)")
    bench.add_argument("--out", default=None, help="write the rows as JSON to this file")
    bench.add_argument("--ranks", type=int, default=None, help="world size (default: the benchmark's own)")
    bench.add_argument(
        "--tokens",
        default=None,
        help="tp: token counts (batch x sequence) to sweep, comma-separated, e.g. 128,1024,4096,16384: "
        "every mode with keep_blocks off and on, and the token count past which each moves fewer bytes than 1D",
    )
    bench.add_argument(
        "--calibrate",
        action="store_true",
        help="plan: measure this machine first and rank the predicted step times against the measured ones",
    )
    bench.add_argument(
        "--only",
        default=None,
        help="plan: comma-separated indices of the layouts to measure; lora: 'largest' (only the largest-model searches); "
        "compile: comma-separated layouts (dp2, zero3-dp2, tp1d-tp2, pp2-1f1b, sp2-ring) and models (gpt2, gpt2-medium)",
    )
    bench.add_argument(
        "--scenarios",
        action="store_true",
        help="plan: time the planner on the At-scale scenarios (70B on 1,024 GPUs and the 64-GPU paper settings) "
        "instead of measuring layouts",
    )
    bench.add_argument(
        "--workload",
        action="store_true",
        help="serve: the server under a realistic load (Poisson arrivals, long-tailed lengths, a shared prefix) "
        "against HF generate in static batches and transformers' continuous batching",
    )
    bench.add_argument("--rates", default=None, help="serve --workload: arrival rates, requests/s, e.g. 1,6")
    bench.add_argument("--requests", type=int, default=None, help="serve --workload: requests per rate")
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="serve --workload: a workload field (sizes, lengths, prefix, max_batch; "
        "tessera.bench.serve_load.LoadWorkload), e.g. --set hidden=128 --set prefix_fraction=0.25",
    )
    bench.set_defaults(func=_cmd_bench)

    ckpt.add_parser(sub)
    serving.add_parsers(sub)
    alignment.add_parser(sub)
    return parser


def _version() -> str:
    from tessera import __version__

    return __version__


def _cmd_run(argv: Sequence[str]) -> int:
    from tessera.cli.launching import RUN_USAGE, cmd_run

    if not argv or argv[0] in ("-h", "--help"):
        from torch.distributed.run import get_args_parser

        print(RUN_USAGE + "\n\ntorchrun's options follow.\n")
        get_args_parser().print_help()
        return 0
    return cmd_run(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    try:
        if command == "run":  # argparse cannot pass torchrun's options through untouched
            return _cmd_run(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except TesseraError as exc:
        print(f"tessera {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
