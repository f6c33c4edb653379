"""Tools for a sharded checkpoint folder outside training: what it holds, whether it is whole,
and one full safetensors file of it.

- :func:`inspect` reads the index and the files' headers (no tensor data): the layout that
  wrote the checkpoint, the step, counts and bytes of model tensors, optimizer states and RNG
  states, every file's size, every tensor (full shape, dtype, pieces, bytes), and whether it is
  complete: every tensor covered by its pieces (``format.missing_elements``), every file the
  index names present, of the size its header says, and holding the pieces the index puts
  there. :func:`format_inspection` turns that into text (``tessera ckpt inspect``).
- :func:`consolidate` writes the single-process state (the keys ``full_state_dict`` gives) as
  one safetensors file, one tensor at a time: the header is known from the index, so it is
  written first, then each tensor is assembled from its pieces (``placing.fill``), written and
  freed. Peak memory is one full tensor plus one block of it, whatever the checkpoint's size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.format import (
    INDEX,
    CheckpointError,
    dtype_of,
    encode_header,
    itemsize,
    missing_elements,
    raw_bytes,
    read_header,
    read_index,
    reading,
)
from tessera.checkpoint.placing import fill
from tessera.context.views import View, whole_view
from tessera.files import atomic_path

# index name prefix -> the group it belongs to
GROUPS = {"model/": "model", "optim/": "optimizer", "rng/": "rng"}


def _group(name: str) -> str:
    return next((group for prefix, group in GROUPS.items() if name.startswith(prefix)), "other")


def _open_index(path: str | Path) -> dict[str, Any]:
    """The index of ``path``; a folder of checkpoints (or a partial one) fails saying so."""
    folder = Path(path)
    if folder.is_dir() and not (folder / INDEX).exists():
        inside = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / INDEX).is_file())
        if inside:
            shown = ", ".join(inside[-5:]) if len(inside) <= 5 else f"..., {', '.join(inside[-5:])}"
            raise CheckpointError(f"{folder} is not a checkpoint but holds {len(inside)}: {shown}")
        raise CheckpointError(f"{folder} is not a complete checkpoint: it has no {INDEX} (a save cut short?)")
    return read_index(folder)


# ---- inspect ---------------------------------------------------------------------------------


def _tensor_row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    size = itemsize(entry["dtype"])
    stored = sum(
        (p["flat"][1] - p["flat"][0]) if p.get("flat") else math.prod(p["local_shape"]) for p in entry["pieces"]
    )
    return {
        "name": name,
        "group": _group(name),
        "shape": list(entry["shape"]),
        "dtype": entry["dtype"],
        "pieces": len(entry["pieces"]),
        "bytes": math.prod(entry["shape"]) * size,
        "stored_bytes": stored * size,
        "missing_elements": missing_elements(entry),
    }


def _check_files(folder: Path, tensors: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every file of the folder and every file the index names: its size, the size its header
    says, and problems (missing, wrong size, unreadable, a piece it lacks)."""
    wanted: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, entry in tensors.items():
        for piece in entry["pieces"]:
            wanted.setdefault(piece["file"], []).append((name, piece))
    present = {p.name for p in folder.iterdir() if p.is_file()}
    files: list[dict[str, Any]] = []
    problems: list[str] = []
    for file in sorted(present | set(wanted)):
        path = folder / file
        row: dict[str, Any] = {"name": file, "bytes": None, "expected_bytes": None, "pieces": len(wanted.get(file, []))}
        files.append(row)
        if file not in present:
            holds = sorted({name for name, _ in wanted[file]})
            problems.append(f"{file} is missing (it holds pieces of {len(holds)} tensors, e.g. {holds[0]})")
            continue
        row["bytes"] = path.stat().st_size
        if not file.endswith(".safetensors"):
            continue
        try:
            header, row["expected_bytes"] = read_header(path)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(f"{file} is unreadable: {exc}")
            continue
        if row["bytes"] != row["expected_bytes"]:
            problems.append(
                f"{file} has {row['bytes']:,} bytes, its header says {row['expected_bytes']:,} (truncated?)"
            )
        for name, piece in wanted.get(file, []):
            stored = header.get(piece["key"])
            numel = (piece["flat"][1] - piece["flat"][0]) if piece.get("flat") else math.prod(piece["local_shape"])
            if stored is None:
                problems.append(f"{file} lacks the piece {piece['key']!r} of {name}")
            elif stored["dtype"] != tensors[name]["dtype"] or math.prod(stored["shape"]) != numel:
                problems.append(
                    f"{file}: the piece {piece['key']!r} of {name} is {stored['dtype']} {stored['shape']}, "
                    f"the index says {tensors[name]['dtype']} with {numel} elements"
                )
    return files, problems


def inspect(path: str | Path) -> dict[str, Any]:
    """What the checkpoint folder ``path`` holds and whether it is complete, as JSON data:
    ``layout`` (world size, axis sizes, tensor mode and depth, strategy), ``step``, ``groups``
    (per group "model", "optimizer", "rng": tensor count and full bytes), ``files`` (name,
    bytes, the bytes its header implies), ``tensors`` (name, group, full shape, dtype, pieces,
    full bytes, bytes stored, elements no piece holds; largest first), ``complete`` and
    ``problems`` (what is missing, one line each). Reads headers only, no tensor data; raises
    ``CheckpointError`` if ``path`` is not a checkpoint folder."""
    folder = Path(path)
    index = _open_index(folder)
    tensors: dict[str, Any] = index["tensors"]
    rows = sorted((_tensor_row(n, e) for n, e in tensors.items()), key=lambda r: (-r["bytes"], r["name"]))
    groups: dict[str, dict[str, int]] = {g: {"count": 0, "bytes": 0} for g in (*GROUPS.values(), "other")}
    for row in rows:
        groups[row["group"]]["count"] += 1
        groups[row["group"]]["bytes"] += row["bytes"]
    if not groups["other"]["count"]:
        del groups["other"]
    files, problems = _check_files(folder, tensors)
    problems = [
        f"{r['name']}: {r['missing_elements']:,} of {math.prod(r['shape']):,} elements are in no piece"
        for r in rows
        if r["missing_elements"]
    ] + problems
    model = {n[len("model/") :] for n in tensors if n.startswith("model/")}
    problems += [
        f"the alias {a} names {s}, which the checkpoint lacks"
        for a, s in index.get("aliases", {}).items()
        if s not in model
    ]
    layout = index.get("layout", {})
    dims = layout.get("dims", {})
    return {
        "path": str(folder),
        "step": index.get("step"),
        "layout": {
            "world_size": layout.get("world_size"),
            "sizes": layout.get("sizes", {}),
            "tensor_mode": dims.get("tensor_mode"),
            "tensor_depth": dims.get("tensor_depth"),
            "strategy": index.get("strategy"),
        },
        "aliases": dict(index.get("aliases", {})),
        "groups": groups,
        "files": files,
        "total_file_bytes": sum(f["bytes"] or 0 for f in files),
        "tensors": rows,
        "complete": not problems,
        "problems": problems,
    }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _layout_line(layout: dict[str, Any]) -> str:
    sizes = ", ".join(f"{axis} {n}" for axis, n in layout["sizes"].items())
    mode = layout.get("tensor_mode")
    if mode and layout["sizes"].get("tensor", 1) > 1:
        mode += f" depth {layout['tensor_depth']}" if mode == "2.5d" else ""
        sizes += f" ({mode})"
    return f"world size {layout['world_size']}: {sizes}; strategy {layout['strategy']}"


def format_inspection(info: dict[str, Any], *, all_tensors: bool = False, largest: int = 20) -> str:
    """:func:`inspect`'s answer as text: the summary, the files, the ``largest`` tensors (every
    one with ``all_tensors``) and the completeness verdict with what is missing."""
    lines = [
        f"checkpoint  {info['path']}",
        f"step        {info['step']}",
        f"layout      {_layout_line(info['layout'])}",
    ]
    for group, g in info["groups"].items():
        lines.append(f"{group:<11} {g['count']} tensors, {g['bytes']:,} bytes ({_size(g['bytes'])})")
    if info["aliases"]:
        lines.append("tied        " + ", ".join(f"{a} = {s}" for a, s in info["aliases"].items()))
    lines.append(
        f"files       {len(info['files'])}, {info['total_file_bytes']:,} bytes ({_size(info['total_file_bytes'])})"
    )
    width = max(len(f["name"]) for f in info["files"])
    for f in info["files"]:
        size = "MISSING" if f["bytes"] is None else f"{f['bytes']:,}"
        pieces = f"  {f['pieces']} pieces" if f["pieces"] else ""
        lines.append(f"  {f['name']:<{width}} {size:>15}{pieces}")
    rows = info["tensors"] if all_tensors else info["tensors"][:largest]
    shown = (
        "every tensor"
        if len(rows) == len(info["tensors"])
        else f"the {len(rows)} largest of {len(info['tensors'])} (--all: every one)"
    )
    lines.append(f"tensors     {shown}")
    table = [("name", "shape", "dtype", "pieces", "bytes")]
    table += [
        (r["name"], "x".join(map(str, r["shape"])) or "scalar", r["dtype"], str(r["pieces"]), f"{r['bytes']:,}")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        lines.append(
            "  " + "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
    if info["complete"]:
        lines.append("complete    yes: every tensor is covered and every file is whole")
    else:
        lines.append(f"complete    NO: {len(info['problems'])} problem(s)")
        lines += [f"  {p}" for p in info["problems"]]
    return "\n".join(lines)


# ---- consolidate -----------------------------------------------------------------------------


def _outputs(index: dict[str, Any], optimizer: bool) -> list[tuple[str, str, list[str]]]:
    """``(index name, dtype, output keys)`` for every tensor the file gets: model tensors under
    their single-process keys, each followed by its tied aliases; optimizer states as
    ``optim/<key>/<state>`` with ``optimizer``."""
    tensors = index["tensors"]
    aliases: dict[str, list[str]] = {}
    for alias, source in index.get("aliases", {}).items():
        aliases.setdefault(source, []).append(alias)
    out = []
    for name, entry in tensors.items():
        if name.startswith("model/"):
            key = name[len("model/") :]
            out.append((name, entry["dtype"], [key, *sorted(aliases.pop(key, []))]))
        elif optimizer and name.startswith("optim/"):
            out.append((name, entry["dtype"], [name]))
    if aliases:
        raise CheckpointError(f"the checkpoint's aliases name tensors it lacks: {sorted(aliases)}")
    return out


def consolidate(path: str | Path, out: str | Path, *, optimizer: bool = False) -> dict[str, Any]:
    """Write the checkpoint folder ``path`` as one safetensors file ``out`` under the
    single-process keys (what ``full_state_dict`` gives; tied aliases as copies of their
    source), at the dtype the checkpoint holds (fp32 masters under mixed-precision ZeRO); with
    ``optimizer`` also each optimizer state as ``optim/<key>/<state>``. Streams one tensor at a
    time, every piece's CRC-32 checked; the file appears atomically. Returns a summary:
    ``path``, ``tensors`` (keys written), ``bytes`` (the file's size)."""
    index = _open_index(path)
    tensors = index["tensors"]
    plan = _outputs(index, optimizer)
    entries = [(key, dtype, tensors[name]["shape"]) for name, dtype, keys in plan for key in keys]
    metadata = {"format": "pt", "tessera_step": str(index.get("step"))}
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with reading(path) as reader, atomic_path(target) as tmp, open(tmp, "wb") as f:
        f.write(encode_header(entries, metadata))
        for name, dtype, keys in plan:
            entry = tensors[name]
            value = torch.empty(entry["shape"], dtype=dtype_of(dtype))
            view: View = whole_view(entry["shape"])
            fill(reader, name, entry, value, view)
            data = raw_bytes(value)
            for _ in keys:
                f.write(data)
            del value, data
        f.flush()
    return {"path": str(target), "tensors": len(entries), "bytes": target.stat().st_size}
