"""``tessera rlhf STAGE CONFIG``: one stage of the RLHF pipeline (sft, rm, ppo, dpo, grpo) from a
config file, on ranks started through torchrun (:mod:`tessera.rlhf_pipeline`).

Checked here, before any process starts, in one line with exit code 2: the config and its
``--set`` overrides, and the stage's plan on the world the command starts (each model's ranks
and layout, batch sizes against data ranks and accumulation, the weights each model starts
from). This module does not import torch; the command imports the pipeline when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

STAGES = ("sft", "rm", "ppo", "dpo", "grpo")
STAGE_HELP = {
    "sft": "supervised fine-tuning of the policy on demonstrations",
    "rm": "a reward model (a value model) on preference pairs",
    "ppo": "PPO: actor, critic, reference and reward, each on ranks of its own",
    "dpo": "DPO: the policy on preference pairs against a frozen reference",
    "grpo": "GRPO: groups of sampled responses, no critic",
}


def add_parser(sub: Any) -> None:
    """Add ``rlhf`` to the ``tessera`` subparsers ``sub``."""
    stages = "\n".join(f"  {name:5} {text}" for name, text in STAGE_HELP.items())
    rlhf = sub.add_parser(
        "rlhf",
        help="one stage of the RLHF pipeline (sft, rm, ppo, dpo, grpo) from a config file",
        description="Run one stage of the RLHF pipeline; each writes its folder (weights, metrics.jsonl, "
        "plots) where the next stage's config reads it. See docs/rlhf-pipeline.md and examples/rlhf/.",
        epilog="stages:\n" + stages,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rlhf.add_argument("stage", choices=STAGES, metavar="STAGE", help="sft, rm, ppo, dpo or grpo (below)")
    rlhf.add_argument("config", metavar="CONFIG", help="the stage's config file (.yaml, .toml, .json, .py)")
    rlhf.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=10 --set actor.optimizer.lr=1e-5",
    )
    rlhf.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc_per_node",
        type=int,
        default=None,
        metavar="N",
        help="processes on this node (default: launch.nproc_per_node)",
    )
    rlhf.add_argument("--output-dir", default=None, help="the stage's folder (default: output_dir of the config)")
    rlhf.set_defaults(func=cmd_rlhf)


def cmd_rlhf(args: argparse.Namespace) -> int:
    """Validate the stage's config and plan here, then start its ranks."""
    from tessera.cli.launching import check_overrides, start_ranks
    from tessera.errors import ConfigError
    from tessera.rlhf_pipeline import default_run_dir, load_stage_config, plan_stage

    check_overrides(args.set, [args.config])
    cfg = load_stage_config(args.stage, args.config, args.set)  # a bad config fails before any process starts
    nproc = args.nproc_per_node or cfg.launch.nproc_per_node
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc}: give at least 1 process")
    given = "--nproc-per-node" if args.nproc_per_node else "launch.nproc_per_node; change it with --nproc-per-node"
    plan_stage(args.stage, cfg, nproc, f"tessera rlhf starts {nproc} process(es): {given}")
    run_dir = Path(args.output_dir) if args.output_dir else default_run_dir(args.stage, cfg)
    argv = ["--standalone", "--nproc-per-node", str(nproc), "-m", "tessera.cli.rank"]
    argv += ["--module", "tessera.rlhf_pipeline", "--", args.stage, str(args.config), "--run-dir", str(run_dir)]
    for item in args.set:
        argv += ["--set", item]
    return start_ranks(argv, run_dir, "rlhf", {})
