"""``tessera plan``: search the parallel layouts of a model on a cluster, print them ranked by
predicted step time with the reason the best wins, and write the best as a config file.

``tessera plan --model gpt:gpt2-medium --devices 8 --device-memory 16GiB [--nodes 2]
[--global-batch N] [--seq-len N] [--dtype bf16] [--calibrate] [--top 10] [--out best.py]
[--set parallel.tensor.mode=2d ...]``

``--set KEY=VALUE`` fixes a choice by its config key and lets the planner choose the rest; the
assignments are checked as a config is, so a combination the layout rules refuse is refused
here in the words the config and ``initialize`` use. ``--set lora.rank=16`` (and the other
``lora.*`` keys: targets, modules_to_save, quantize, double_quant, dropout) plans LoRA fine-tuning
instead: adapters that train beside a frozen, possibly quantized, base (docs/planner.md).

The cluster's figures come from ``--hardware`` (default: A100 80GB in DGX nodes; see
``tessera.planner.scenarios.HARDWARE`` for the figures and their sources), overridden one by one
with ``--flops``, ``--intra-bw``, ``--inter-bw``, ``--intra-latency``, ``--inter-latency``, or
measured on this machine with ``--calibrate``. This module does not import torch; a ``gpt:`` or
``vit:`` preset does (to read the preset's sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError

PLAN_FORMATS = (".py", ".toml", ".yaml", ".yml", ".json")


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the ``tessera`` subparsers ``sub``."""
    from tessera.planner.scenarios import HARDWARE, UTILISATION

    p = sub.add_parser(
        "plan",
        help="rank the parallel layouts of a model on a cluster by predicted step time and write the best config",
        description="Search data, pipeline (schedule, micro-batches), tensor (1d/2d/2.5d/3d), sequence, ZeRO, "
        "offload, activation checkpointing and micro-batch size for the model on the cluster; print the layouts "
        "that fit, fastest first, with the baselines (pure ZeRO-3, pure 1D tensor parallelism) and why the best "
        "wins; write the best as a config that `tessera train --config` runs (docs/planner.md).",
    )
    p.add_argument("--model", required=True, metavar="NAME",
                   help="gpt:PRESET (tessera's GPT: tiny, small, gpt2, gpt2-medium, ...), vit:PRESET, hf:PATH (a "
                   "Hugging Face config.json or its folder), or llama:7b, llama:13b, llama:70b, gpt3:175b")  # fmt: skip
    p.add_argument("--devices", type=int, required=True, help="devices (ranks) in all")
    p.add_argument("--nodes", type=int, default=None, help="nodes they sit in (default: 8 devices a node)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="usable memory per device, e.g. 16GiB (default: the hardware's, less 2 GiB)")  # fmt: skip
    p.add_argument("--host-memory", default=None, metavar="SIZE", help="host memory per device for offload")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (default: 8 a device)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "lamb", "lars"), default="adamw")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="a100-80gb",
                   help="device and link figures (default a100-80gb: 312 TFLOP/s bf16, NVLink 230 GB/s, InfiniBand "
                   f"24 GB/s per GPU; compute at {UTILISATION * 100:.0f}%% of peak)")  # fmt: skip
    p.add_argument("--flops", type=float, default=None, help="sustained FLOP/s per device (overrides --hardware)")
    p.add_argument("--intra-bw", type=float, default=None, metavar="GB/S", help="bandwidth within a node, GB/s")
    p.add_argument("--inter-bw", type=float, default=None, metavar="GB/S", help="bandwidth across nodes, GB/s")
    p.add_argument("--intra-latency", type=float, default=None, metavar="US", help="latency within a node, us")
    p.add_argument("--inter-latency", type=float, default=None, metavar="US", help="latency across nodes, us")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's compute rate and per-axis bandwidth with short runs first")  # fmt: skip
    p.add_argument("--top", type=int, default=10, help="ranked rows to print (default 10)")
    p.add_argument("--exhaustive", action="store_true", help="estimate every layout that fits (slower)")
    p.add_argument("--set", action="append", default=[], dest="fixed", metavar="KEY=VALUE",
                   help="fix a choice by its config key, the planner choosing the rest (repeatable): "
                   "parallel.tensor.size=4, parallel.tensor.mode=2d, parallel.sequence.size=2, zero.stage=1, ...; "
                   "lora.rank=16, lora.quantize=nf4, ... plan LoRA fine-tuning; refused as the config refuses it")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the best layout as a config: .py, .toml, .yaml or .json")  # fmt: skip
    p.set_defaults(func=cmd_plan)


def cluster_of(args: argparse.Namespace) -> Any:
    """The cluster the command line describes (ConfigError for an impossible one)."""
    from tessera.config.schema import parse_bytes
    from tessera.planner.scenarios import HARDWARE
    from tessera.planner.spec import Link

    if args.devices < 1:
        raise ConfigError(f"--devices={args.devices} must be at least 1")
    nodes = args.nodes or max(1, -(-args.devices // 8))
    if nodes < 1 or args.devices % nodes:
        given = f"--nodes={nodes}" if args.nodes else f"{nodes} nodes of 8 (give --nodes)"
        raise ConfigError(f"--devices={args.devices} is not a multiple of {given}: each node holds as many devices")
    hardware = HARDWARE[args.hardware]
    memory = parse_bytes(args.device_memory, "--device-memory")
    cluster = hardware.cluster(
        args.devices, dtype=args.dtype, device_memory=memory, devices_per_node=args.devices // nodes
    )
    intra, inter = cluster.intra, cluster.inter
    intra = Link(args.intra_bw * 1e9 if args.intra_bw else intra.bandwidth,
                 args.intra_latency * 1e-6 if args.intra_latency else intra.latency)  # fmt: skip
    inter = Link(args.inter_bw * 1e9 if args.inter_bw else inter.bandwidth,
                 args.inter_latency * 1e-6 if args.inter_latency else inter.latency)  # fmt: skip
    return dataclasses.replace(
        cluster,
        flops=args.flops or cluster.flops,
        intra=intra,
        inter=inter,
        host_memory=parse_bytes(args.host_memory, "--host-memory"),
    )


def calibrated(cluster: Any, args: argparse.Namespace) -> Any:
    """``cluster`` with this machine's measured compute, optimizer and copy rates and per-axis links
    (``tessera.planner.calibrate``: ranks of this machine, at most 8, measured together)."""
    from tessera.bench.calibrate import calibrate
    from tessera.config.schema import parse_bytes
    from tessera.planner.calibrate import calibrated_cluster, describe

    calibration = calibrate(min(cluster.devices, 8))
    print(describe(calibration), file=sys.stderr)
    memory = parse_bytes(args.device_memory, "--device-memory")  # default: this machine's, shared
    measured = calibrated_cluster(calibration, cluster.devices, memory)
    # calibration measures one node: a group across nodes keeps the given link between them
    return dataclasses.replace(measured, devices_per_node=cluster.devices_per_node, host_memory=cluster.host_memory,
                               inter=cluster.inter if cluster.nodes > 1 else measured.inter)  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    from tessera.planner.search import Limits, plan
    from tessera.planner.spec import Workload, resolve_model

    lora_sets = [item for item in args.fixed if item.split("=", 1)[0].strip().startswith("lora.")]
    lora = lora_of(lora_sets)
    model = dataclasses.replace(resolve_model(args.model, args.seq_len), adapters=adapters_of(lora))
    cluster = cluster_of(args)
    if args.calibrate:
        cluster = calibrated(cluster, args)
    if args.top < 1:
        raise ConfigError(f"--top={args.top} must be at least 1")
    workload = Workload(global_batch=args.global_batch or 8 * args.devices, seq_len=args.seq_len, dtype=args.dtype,
                        optimizer=args.optimizer)  # fmt: skip
    pins = fixed_fields([item for item in args.fixed if item not in lora_sets])
    limits = Limits(exhaustive=args.exhaustive, pins=pins, max_sequence=max(8, pins.get("sequence", 1)))
    result = plan(model, cluster, workload, top=args.top, limits=limits)
    print(f"tessera plan: {model.describe()}; {workload.global_batch} samples a step, {args.dtype}; "
          f"{cluster.name}, {cluster.devices_per_node} a node, {cluster.device_memory / 2**30:.1f} GiB each; "
          f"{result.stats.describe()}", file=sys.stderr)  # fmt: skip
    if model.adapters is not None:
        from tessera.planner.adapters import describe

        print(describe(model))
    print(result.table(markdown=args.markdown))
    best = result.best  # nothing fits: a ConfigError saying by how much the nearest misses
    print("\nbest: " + result.summary())
    if args.out:
        path = write_config(best.layout, args.model, workload, Path(args.out), lora)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def lora_of(assignments: list[str]) -> dict[str, Any] | None:
    """The ``lora`` section that ``--set lora.KEY=VALUE`` assignments give, checked as a config's
    is (None without a rank: no adapters)."""
    from tessera.config import load_config

    if not assignments:
        return None
    section = load_config(None, assignments).lora
    return dataclasses.asdict(section) if section.rank else None


def adapters_of(lora: dict[str, Any] | None) -> Any:
    """The planner's :class:`~tessera.planner.adapters.Adapters` of a ``lora`` section (or None)."""
    from tessera.config.schema import LoraConfig
    from tessera.planner.adapters import Adapters

    return Adapters.from_config(LoraConfig(**lora)) if lora else None


def fixed_fields(assignments: list[str]) -> dict[str, Any]:
    """The layout fields that ``--set KEY=VALUE`` fixes. The assignments are loaded as a config
    first, so a wrong type or a combination the layout rules refuse (``tessera.context.rules``)
    is refused in the words of the config, ``initialize`` and the planner; each key must be one
    the planner chooses (``tessera.planner.layout.CONFIG_FIELDS``)."""
    from tessera.config import load_config
    from tessera.planner.layout import CONFIG_FIELDS, fields_of_config

    if not assignments:
        return {}
    config = load_config(None, assignments)
    values: dict[str, Any] = {}
    for item in assignments:
        key = item.split("=", 1)[0].strip()
        if key not in CONFIG_FIELDS:
            raise ConfigError(f"--set {key}: not a choice the planner makes; it fixes {', '.join(CONFIG_FIELDS)}")
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part)
        values[key] = value
    return fields_of_config(values)


# ---- the config file of a layout ---------------------------------------------------------------------


def config_of(layout: Any, model_name: str, workload: Any, lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tessera config that trains ``model_name`` with ``layout``: the layout's sections, the
    model's (for gpt: presets and hf: paths, which ``tessera train`` builds), the sequence length,
    the dtype and the ``lora`` section planned for."""
    config: dict[str, Any] = layout.to_config()
    kind, _, rest = model_name.partition(":")
    if kind == "gpt" and rest:
        config["model"] = {"name": "gpt", "preset": rest}
    elif kind == "hf" and rest:
        config["model"] = {"name": model_name}
    if workload.seq_len:
        config["data"]["seq_len"] = workload.seq_len
    config["mixed_precision"] = {"dtype": workload.dtype}
    if lora:
        config["lora"] = dict(lora)
    return config


def write_config(layout: Any, model_name: str, workload: Any, path: Path, lora: dict[str, Any] | None = None) -> Path:
    """Write :func:`config_of` to ``path`` in the format its suffix names."""
    from tessera.files import write_atomically

    suffix = path.suffix.lower()
    if suffix not in PLAN_FORMATS:
        raise ConfigError(f"--out {path}: unknown format {suffix!r}; use {', '.join(PLAN_FORMATS)}")
    config = config_of(layout, model_name, workload, lora)
    head = f"tessera plan --model {model_name}: {layout.name()}"
    if suffix == ".py":
        text = f'"""{head}."""\n\n' + "".join(f"{key} = {value!r}\n" for key, value in config.items())
    elif suffix == ".json":
        text = json.dumps(config, indent=2) + "\n"
    elif suffix == ".toml":
        text = f"# {head}\n" + toml_text(config)
    else:
        import yaml

        text = f"# {head}\n" + yaml.safe_dump(config, sort_keys=False)
    write_atomically(path, text)
    return path


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """A TOML document of nested dicts of plain values (tables after the table's own keys)."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items() if not isinstance(value, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            name = f"{prefix}{key}"
            lines += ["", f"[{name}]", toml_text(value, name + ".").rstrip("\n")]
    return "\n".join(line for line in lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
