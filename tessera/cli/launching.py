"""``tessera train`` and ``tessera run``: check what can be checked before any process starts,
start the ranks through torchrun, and report a failure once.

Checked here, in one line with exit code 2: the config and its ``--set`` overrides, and the
layout against the world the command will start (processes per node x nodes). For ``run``, the
script's config is known when it is named with ``--config``; otherwise the script is started
once in a dry validation (``tessera.launcher``), where its ``launch_from_torch`` checks the
config and ends the process before any rank exists.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tessera.cli.rank import RUN_DIR_ENV
from tessera.errors import ConfigError, TesseraError


class UsageError(TesseraError):
    """A command line that cannot mean what it says (reported in one line, exit code 2)."""


def check_overrides(items: Sequence[str], following: Sequence[str] = ()) -> None:
    """Every ``--set`` item is KEY=VALUE; a bare key followed by its value gets a hint."""
    for item in items:
        if "=" not in item:
            hint = f"; did you mean --set {item}={following[0]}?" if following else ""
            raise UsageError(f"--set {item}: an override is KEY=VALUE{hint}")


def check_world(config: Any, world_size: int, started: str) -> None:
    """The layout of ``config`` on ``world_size`` ranks, or the ConfigError that says why not
    (and where the world size came from: ``started``)."""
    from tessera.config import parallel_dims, require_available, resolve_auto, resolve_batch

    try:
        resolved = resolve_auto(config, world_size)  # parallel="auto": a layout must fit
        resolve_batch(resolved, parallel_dims(resolved, world_size).data_size)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({started})") from None
    require_available(config)


def script_run_dir(stem: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"


def start_ranks(torchrun_argv: Sequence[str], run_dir: Path, command: str, env: dict[str, str]) -> int:
    """Run torchrun in this process; on failure print each rank's error once and return 2 (a
    tessera error) or 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # tessera sets each rank's threads from the config
    os.environ[RUN_DIR_ENV] = str(run_dir)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report failures
    try:
        run(parse_args(list(torchrun_argv)))
    except ChildFailedError as exc:
        return report_failures(run_dir / "logs", command, {int(r): f.exitcode for r, f in exc.failures.items()})
    return 0


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def report_failures(log_dir: Path, command: str, exit_codes: dict[int, int]) -> int:
    """Print every distinct error the ranks wrote once, lowest rank first."""
    groups: dict[tuple[str, str], list[int]] = {}
    tessera_only = True
    for path in sorted(log_dir.glob("rank*.json")):
        info = json.loads(path.read_text())
        key = (info["type"], info["message"]) if not info["tessera"] else ("", info["message"])
        groups.setdefault(key, []).append(int(info["rank"]))
        tessera_only = tessera_only and bool(info["tessera"])
    for (kind, message), ranks in sorted(groups.items(), key=lambda g: min(g[1])):
        first, others = min(ranks), [r for r in ranks if r != min(ranks)]
        also = f" (the same on {_ranges(others)})" if others else ""
        text = f"{kind}: {message}" if kind else message
        print(f"tessera {command}: error on rank {first}{also}: {text}", file=sys.stderr)
    reported = {r for ranks in groups.values() for r in ranks}
    for rank, code in sorted(exit_codes.items()):
        if rank not in reported:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"tessera {command}: rank {rank} ended with {how} (its output is above)", file=sys.stderr)
    if groups:
        print(f"tessera {command}: tracebacks: {log_dir}/rank<N>.log", file=sys.stderr)
    return 2 if groups and tessera_only and reported >= set(exit_codes) else 1


# ---- tessera train ----------------------------------------------------------------------------


def train_overrides(args: Any) -> list[str]:
    """``--set`` overrides of ``tessera train``'s command line, ``--model`` and ``--data`` among them."""
    following = [args.config] if args.config is not None else []
    check_overrides(args.set, following)
    overrides = list(args.set)
    if getattr(args, "model", None) is not None:
        overrides.append(f"model.name={args.model}")
    if getattr(args, "data", None):
        overrides += ["data.name=text_files", f"data.files={json.dumps(list(args.data))}"]
    return overrides


def check_data_files(cfg: Any) -> None:
    """Every path ``data.files`` names exists (read on the ranks)."""
    for given in cfg.data.files:
        if not Path(given).exists():
            raise ConfigError(f"data.files: {given} does not exist (give text files or folders of them)")


def cmd_train(args: Any) -> int:
    """Validate the config, layout, model and data here, then start the ranks of ``tessera.train``."""
    from tessera.config import check_model_layout, default_run_dir, load_config

    overrides = train_overrides(args)
    cfg = load_config(args.config, overrides)  # a bad config fails before any process starts
    check_model_layout(cfg)  # tessera train builds config.model, named or default
    check_data_files(cfg)
    if cfg.model.hf_path is not None:
        from tessera.hf.train import check_causal_lm  # imports transformers (and torch)

        check_causal_lm(cfg.model.hf_path, cfg.model.options, cfg.data.seq_len)
    nproc = args.nproc_per_node or cfg.launch.nproc_per_node
    given = "--nproc-per-node" if args.nproc_per_node else "launch.nproc_per_node; change it with --nproc-per-node"
    world_opts = host_options(args)
    nnodes = (_option(world_opts, "--nnodes") or "1").split(":")
    if not all(n.isdigit() and int(n) >= 1 for n in nnodes) or len(nnodes) > 2:
        raise ConfigError(f"tessera train: --nnodes {':'.join(nnodes)} is not a number of hosts (N, or MIN:MAX)")
    if int(nnodes[-1]) > 1:
        for hosts in dict.fromkeys(int(n) for n in nnodes):  # each world the job may run on
            check_world(cfg, nproc * hosts, f"tessera train starts {nproc * hosts} processes: "
                        f"{nproc} ({given}) on each of {hosts} host(s)")  # fmt: skip
        if not args.output_dir:
            raise ConfigError(
                "tessera train across hosts needs --output-dir: one run folder that every host names the same "
                "(on a file system they share), since each host would otherwise name its own after its clock"
            )
    else:
        check_world(cfg, nproc, f"tessera train starts {nproc} processes: {given}")
    resumed = None
    if getattr(args, "resume", None) is not None:
        resumed = find_checkpoint(args.resume, Path(cfg.trainer.output_dir))
        overrides.append(f"trainer.resume={resumed}")
    if args.output_dir:
        run_dir = Path(args.output_dir)
    elif resumed is not None and resumed.parent.name == "checkpoints":
        run_dir = resumed.parent.parent  # the run goes on in its own folder
    else:
        run_dir = default_run_dir(cfg)
    one_host = _option(world_opts, "--nnodes") is None
    argv = [*(["--standalone"] if one_host else []), *world_opts, "--nproc-per-node", str(nproc)]
    argv += ["-m", "tessera.cli.rank", "--module", "tessera.train"]
    argv += ["--", "--run-dir", str(run_dir)]
    if args.config is not None:
        argv.append(str(args.config))
    for item in overrides:
        argv += ["--set", item]
    return start_ranks(argv, run_dir, "train", {})


_HOST_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                 "rdzv_conf", "max_restarts")  # fmt: skip


def host_options(args: Any) -> list[str]:
    """torchrun's options for a job across hosts that ``tessera train`` was given (none: one host)."""
    given = {name: getattr(args, name, None) for name in _HOST_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    static = {"node_rank", "master_addr", "master_port"} & set(given)
    dynamic = {"rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf"} & set(given)
    if static and dynamic:
        raise ConfigError("tessera train: give --node-rank/--master-addr/--master-port (a static rendezvous) or "
                          "--rdzv-backend/--rdzv-endpoint/--rdzv-id (a dynamic one), not both")  # fmt: skip
    if set(given) - {"max_restarts"} and "nnodes" not in given:
        raise ConfigError("tessera train: a job across hosts needs --nnodes (the number of hosts)")
    return [f"--{name.replace('_', '-')}={value}" for name, value in given.items()]


def _complete(folder: Path) -> bool:
    return (folder / "index.json").is_file()  # a checkpoint is complete once its index is written


def _newest_in(checkpoints: Path) -> Path | None:
    found = sorted(p for p in checkpoints.glob("step-*") if p.is_dir() and _complete(p)) if checkpoints.is_dir() else []
    return found[-1] if found else None


def find_checkpoint(spec: str, output_dir: Path) -> Path:
    """The checkpoint ``tessera train --resume SPEC`` continues from: a checkpoint folder, a run
    folder's newest checkpoint, or with ``latest`` the newest checkpoint of any run under
    ``output_dir``. Raises ConfigError (before any process starts) when there is none."""
    from tessera.errors import ConfigError

    if spec == "latest":
        runs = sorted(output_dir.glob("*/checkpoints")) if output_dir.is_dir() else []
        newest = [found for found in (_newest_in(c) for c in runs) if found is not None]
        if not newest:
            raise ConfigError(f"--resume latest: no complete checkpoint under {output_dir}/*/checkpoints/")
        return max(newest, key=lambda p: p.stat().st_mtime)
    path = Path(spec)
    if _complete(path):
        return path
    for folder in (path / "checkpoints", path):
        found = _newest_in(folder)
        if found is not None:
            return found
    raise ConfigError(f"--resume {spec}: not a complete checkpoint, nor a run folder or checkpoints folder holding one")


# ---- tessera run ------------------------------------------------------------------------------

RUN_USAGE = (
    "usage: tessera run [--nproc-per-node N] [--config FILE] [--set KEY=VALUE ...] [--run-dir DIR]\n"
    "                   [--no-dry-run] [torchrun options] script.py [args]\n"
    "\n"
    "  --nproc-per-node N, --nproc N  processes on this node (default: launch.nproc_per_node of\n"
    "                                 --config, else 1)\n"
    "  --config FILE     the script's config: checked here, and what its launch_from_torch() loads\n"
    "  --set KEY=VALUE   override a config value on every rank (repeatable)\n"
    "  --run-dir DIR     where a failing rank writes logs/ (default: runs/<time>-<script>)\n"
    "  --no-dry-run      skip starting the script once to check its config before the ranks start\n"
    "Every other option before the script is torchrun's (multi-node ones included)."
)

_OURS = {"--config": 1, "--set": 1, "--run-dir": 1, "--no-dry-run": 0}
_WORLD_FLAGS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
                "--master-port", "--master_port", "--standalone", "--rdzv-backend", "--rdzv_backend")  # fmt: skip


def split_run_argv(argv: Sequence[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(tessera options, torchrun options, [script, *args])`` of ``tessera run``'s argv."""
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    ours: dict[str, Any] = {"--set": []}
    torch_opts: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        name, eq, value = token.partition("=")
        if name == "--nproc":
            name = "--nproc-per-node"
        if name in _OURS:
            if _OURS[name] and not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            if name == "--set":
                check_overrides([value], argv[i + 1 : i + 2])
                ours["--set"].append(value)
            else:
                ours[name] = value if _OURS[name] else True
            i += 1
            continue
        action = actions.get(name)
        if action is None:
            raise UsageError(f"unknown option {name!r} before the script (see tessera run --help)")
        torch_opts.append(name + (eq + value if eq else ""))
        if not eq and action.nargs != 0:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            torch_opts.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        raise UsageError("no script to run\n" + RUN_USAGE)
    return ours, torch_opts, list(argv[i:])


def _option(opts: list[str], *names: str) -> str | None:
    for k, token in enumerate(opts):
        name, eq, value = token.partition("=")
        if name in names:
            return value if eq else (opts[k + 1] if k + 1 < len(opts) else None)
    return None


def dry_validation(python_argv: list[str], world_size: int, env: dict[str, str]) -> str | None:
    """Start the script once without ranks; its ``launch_from_torch`` checks the config against
    ``world_size`` and reports. The error, or None (valid, or the script never asked)."""
    from tessera.launcher import DRY_RUN_ENV

    with tempfile.TemporaryDirectory() as tmp:
        verdict = Path(tmp) / "verdict.json"
        child = {k: v for k, v in {**os.environ, **env}.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        child[DRY_RUN_ENV] = json.dumps({"world_size": world_size, "result": str(verdict)})
        child.setdefault("OMP_NUM_THREADS", "1")
        try:
            subprocess.run([sys.executable, *python_argv], env=child, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        if not verdict.is_file():
            return None
        answer = json.loads(verdict.read_text())
    return None if answer["ok"] else str(answer["error"])


def cmd_run(argv: Sequence[str]) -> int:
    from tessera.launcher import CONFIG_ENV, OVERRIDES_ENV

    ours, torch_opts, target = split_run_argv(argv)
    module_mode = any(t in ("-m", "--module") for t in torch_opts)
    env: dict[str, str] = {}
    if ours["--set"]:
        env[OVERRIDES_ENV] = json.dumps(ours["--set"])
    nproc_text = _option(torch_opts, "--nproc-per-node", "--nproc_per_node")
    cfg = None
    if "--config" in ours:
        from tessera.config import load_config

        cfg = load_config(ours["--config"], ours["--set"])
        env[CONFIG_ENV] = str(Path(ours["--config"]).resolve())
        if nproc_text is None:
            nproc_text = str(cfg.launch.nproc_per_node)
            torch_opts += ["--nproc-per-node", nproc_text]
    nproc_text = nproc_text or "1"  # torchrun's default
    nnodes = _option(torch_opts, "--nnodes") or "1"
    world = int(nproc_text) * int(nnodes) if nproc_text.isdigit() and nnodes.isdigit() else None
    started = f"tessera run starts {world} processes: --nproc-per-node x --nnodes"
    if cfg is not None and world is not None:
        check_world(cfg, world, started)
    elif world is not None and not ours.get("--no-dry-run") and "--no-python" not in torch_opts:
        python_argv = ["-m", *target] if module_mode else target
        error = dry_validation(python_argv, world, env)
        if error is not None:
            raise ConfigError(f"{error} ({started})" if "world" in error else error)
    if not any(_option(torch_opts, flag) is not None or flag in torch_opts for flag in _WORLD_FLAGS):
        torch_opts.append("--standalone")  # one node: a free port, not a fixed 29500
    run_dir = Path(ours["--run-dir"]) if "--run-dir" in ours else script_run_dir(Path(target[0]).stem)
    if "--no-python" in torch_opts:
        argv_out = [*torch_opts, *target]
    else:
        opts = [t for t in torch_opts if t not in ("-m", "--module")]
        kind = "--module" if module_mode else "--script"
        argv_out = [*opts, "-m", "tessera.cli.rank", kind, target[0], "--", *target[1:]]
    return start_ranks(argv_out, run_dir, "run", env)
