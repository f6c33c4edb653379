"""``tessera ckpt``: look into a sharded checkpoint folder and turn it into one file.

- ``tessera ckpt inspect PATH [--all] [--json]``: the layout and step that wrote it, what it
  holds, its files and tensors, and whether it is complete. Exit status 0 when complete, 1 when
  not (the problems are printed), 2 when PATH is not a checkpoint.
- ``tessera ckpt consolidate PATH OUT.safetensors [--optimizer]``: the full single-process state
  as one safetensors file, written tensor by tensor.

This module does not import torch; the commands import ``tessera.checkpoint.tools`` when run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tessera.checkpoint.tools import format_inspection, inspect

    info = inspect(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_inspection(info, all_tensors=args.all))
    return 0 if info["complete"] else 1


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from tessera.checkpoint.tools import consolidate

    done = consolidate(args.path, args.out, optimizer=args.optimizer)
    what = "model tensors and optimizer states" if args.optimizer else "model tensors"
    print(f"wrote {done['path']}: {done['tensors']} {what}, {done['bytes']:,} bytes", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    """Add ``ckpt`` and its commands to the ``tessera`` subparsers ``sub``."""
    ckpt = sub.add_parser(
        "ckpt",
        help="inspect a sharded checkpoint folder or consolidate it into one safetensors file",
        description="Tools for the checkpoint folders tessera.checkpoint.save writes (step-NNNNNNNN/).",
    )
    commands = ckpt.add_subparsers(dest="ckpt_command", metavar="{inspect,consolidate}")
    commands.required = True

    inspect = commands.add_parser(
        "inspect",
        help="layout, step, contents, files and completeness of a checkpoint",
        description="Print what a checkpoint folder holds and check that it is complete: every tensor "
        "covered by its pieces, every file present and as long as its header says. Exit status: 0 "
        "complete, 1 incomplete (the problems are listed), 2 not a checkpoint.",
    )
    inspect.add_argument("path", help="a checkpoint folder (with index.json)")
    inspect.add_argument("--all", action="store_true", help="list every tensor (default: the 20 largest)")
    inspect.add_argument("--json", action="store_true", help="print everything as JSON (every tensor)")
    inspect.set_defaults(func=_cmd_inspect)

    consolidate = commands.add_parser(
        "consolidate",
        help="write the full single-process state as one safetensors file",
        description="Assemble every model tensor from its pieces, one at a time, into one safetensors "
        "file under the single-process keys (tied weights as copies); it loads with "
        "safetensors.torch.load_file and model.load_state_dict.",
    )
    consolidate.add_argument("path", help="a checkpoint folder (with index.json)")
    consolidate.add_argument("out", help="the safetensors file to write")
    consolidate.add_argument(
        "--optimizer", action="store_true", help="also write the optimizer states, as optim/<key>/<state>"
    )
    consolidate.set_defaults(func=_cmd_consolidate)
