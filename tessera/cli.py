"""The ``tessera`` command: run, train, check, bench."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

from tessera.errors import TesseraError

RUN_USAGE = "usage: tessera run --nproc-per-node N [torchrun options] script.py [args]"


def run_torchrun(argv: Sequence[str]) -> int:
    """Hand everything after ``run`` to torchrun (torch.distributed.run), options and all."""
    from torch.distributed.run import main as torchrun_main

    if not argv or argv[0] in ("-h", "--help"):
        print(RUN_USAGE + "\n\nEvery option is torchrun's; its own help follows.\n")
        torchrun_main(["--help"])
        return 0
    torchrun_main(list(argv))
    return 0


def _smoke_all_reduce() -> float:
    import torch

    from tessera import comm, get_context

    ctx = get_context()
    t = torch.full((4,), float(ctx.rank + 1))
    comm.all_reduce(t, "world")
    return float(t[0])


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
}


def _cmd_train(args: argparse.Namespace) -> int:
    """Validate the config here, then start the ranks of ``tessera.train`` through torchrun."""
    from tessera.config import check_model_layout, load_config, require_available
    from tessera.train import default_run_dir

    cfg = load_config(args.config, args.set)  # a bad config fails before any process starts
    check_model_layout(cfg)  # tessera train builds config.model, named or default
    require_available(cfg)
    nproc = args.nproc or cfg.launch.nproc_per_node
    run_dir = args.output_dir or str(default_run_dir(cfg))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = ["--standalone", "--nproc-per-node", str(nproc), "-m", "tessera.train", "--run-dir", run_dir]
    if args.config is not None:
        argv.append(str(args.config))
    for item in args.set:
        argv += ["--set", item]
    return run_torchrun(argv)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from tessera.errors import NotAvailableError

    if args.target not in BENCH_TARGETS:
        known = ", ".join(sorted(BENCH_TARGETS)) or "none yet"
        raise NotAvailableError(f"no benchmark named {args.target!r}; available: {known}")
    module, func = BENCH_TARGETS[args.target].split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Train models too large or too slow for one device: data, tensor, pipeline, "
        "sequence parallelism and ZeRO, configured from a file.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,train,check,bench}")
    sub.required = True

    run = sub.add_parser(
        "run",
        help="launch a script on several processes through torchrun",
        description="Launch through torch.distributed.run (torchrun); every option is torchrun's, "
        "multi-node ones included: tessera run --nproc-per-node N [--nnodes ...] script.py [args]",
        add_help=False,
    )
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER)

    train = sub.add_parser("train", help="train a model from a config (default: the tiny GPT on 4 processes)")
    train.add_argument("config", nargs="?", default=None, help="config file (.py, .yaml, .toml, .json)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set parallel.data=2",
    )
    train.add_argument("--nproc", type=int, default=None, help="local processes (default: launch.nproc_per_node, 4)")
    train.add_argument("--output-dir", default=None, help="the run folder (default: trainer.output_dir/<time>-<model>)")
    train.set_defaults(func=_cmd_train)

    check = sub.add_parser("check", help="print the environment and run a 2-rank all-reduce")
    check.set_defaults(func=_cmd_check)

    bench = sub.add_parser("bench", help="benchmarks against the anchor systems, measured in the same run")
    bench.add_argument("target", choices=sorted(BENCH_TARGETS), help="what to measure: %(choices)s")
    bench.add_argument("--out", default=None, help="write the rows as JSON to this file")
    bench.add_argument("--ranks", type=int, default=None, help="world size (default: the benchmark's own)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # argparse cannot pass options through untouched
        return run_torchrun(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TesseraError as exc:
        print(f"tessera {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
