"""The files of a sharded checkpoint, and reading them back without unpickling anything.

A checkpoint is a folder::

    step-00000020/
      index.json            what every tensor is and where its pieces are (written last)
      rank00000.safetensors the pieces rank 0 wrote
      rank00000.json        rank 0's report: checksums of its pieces, its RNG and data state
      ...

Each piece is stored under ``<name>@<n>`` in its rank's safetensors file. The files are written
here directly in the safetensors layout (an 8-byte header length, a JSON header, the raw
bytes), streamed tensor by tensor with a CRC-32 per piece, so saving neither copies a tensor
nor needs the pieces to be separate storages. ``safetensors.safe_open`` reads them.

The index (see :func:`index_entry`) names, for every tensor, its full shape and dtype and each
piece's file, key, view (``tessera.context.views``) and CRC-32; plus the layout and options that
wrote it, the step, and the JSON state (engine, scheduler, optimizer hyperparameters, data).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tessera.context.views import View
from tessera.errors import TesseraError

FORMAT = "tessera-sharded-checkpoint"
VERSION = 1
INDEX = "index.json"

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class CheckpointError(TesseraError):
    """A checkpoint is incomplete, corrupted, or does not fit the model it is loaded into."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be checkpointed") from None


def dtype_of(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint index") from None


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def rank_report(rank: int) -> str:
    return f"rank{rank:05d}.json"


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order (a view where the tensor is a contiguous CPU
    tensor, else of a contiguous CPU copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def itemsize(dtype: str) -> int:
    """Bytes per element of the index/safetensors dtype name ``dtype`` ("F32", "BF16", ...)."""
    return dtype_of(dtype).itemsize


def encode_header(entries: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]) -> bytes:
    """The start of a safetensors file holding ``(key, dtype name, shape)`` tensors stored one
    after another in this order: the 8-byte header length and the JSON header, padded so that
    the data starts 8-byte aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * itemsize(dtype)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file ``path`` and the file size it implies (the data
    start plus the largest end offset). Raises ``ValueError`` for a file that is not one."""
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", start)
        if length > 100 * 2**20:
            raise ValueError(f"a header of {length} bytes is not plausible")
        text = f.read(length)
    if len(text) < length:
        raise ValueError("its header is cut short")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    return header, 8 + length + max(ends, default=0)


def write_pieces(path: Path, pieces: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Write ``(key, tensor)`` pairs as one safetensors file at ``path``, flushed to disk;
    returns each key's CRC-32. For files inside a checkpoint's partial folder, which is synced
    once and renamed into place when complete (so the file itself needs no rename)."""
    entries = [(key, dtype_name(tensor.dtype), tuple(tensor.shape)) for key, tensor in pieces]
    crcs: dict[str, int] = {}
    with open(path, "wb") as f:
        f.write(encode_header(entries, {"format": FORMAT}))
        for key, tensor in pieces:
            data = raw_bytes(tensor)
            crcs[key] = zlib.crc32(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return crcs


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as compact JSON at ``path`` inside a checkpoint's partial folder: flushed
    to disk and renamed into place, so a reader sees all of it or no file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what} {path} is unreadable: {exc}") from exc


def read_index(path: str | Path) -> dict[str, Any]:
    """The index of the checkpoint folder ``path`` (a complete checkpoint has one)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist (or is not a folder)")
    index = read_json(folder / INDEX, "checkpoint index")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{folder / INDEX} is not a tessera sharded checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"{folder}: checkpoint format version {index.get('version')}, this tessera reads {VERSION}"
        )
    return index


def index_entry(shape: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": dtype_name(dtype), "pieces": []}


def piece_views(entry: dict[str, Any]) -> list[tuple[View, dict[str, Any]]]:
    return [(View.from_json(entry["shape"], p), p) for p in entry["pieces"]]


def missing_elements(entry: dict[str, Any]) -> int:
    """How many elements of the tensor no piece holds (0 for a complete tensor). Pieces of one
    block (ZeRO shards) must tile it; distinct blocks of one layout never overlap."""
    total = math.prod(entry["shape"])
    blocks: dict[View, int] = {}
    for view, _ in piece_views(entry):
        blocks[view.block] = blocks.get(view.block, 0) + view.numel
    covered = 0
    for block, held in blocks.items():
        if held >= math.prod(block.local_shape):
            covered += block.valid_numel()
    return max(0, total - covered)


class Reader:
    """Reads pieces of one checkpoint folder: files opened once (memory-mapped by safetensors),
    every piece's CRC-32 checked; errors name the file and the tensor."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._open: dict[str, Any] = {}

    def close(self) -> None:
        self._open.clear()

    def _file(self, name: str, tensor: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            from safetensors import safe_open

            path = self.folder / name
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (it holds pieces of {tensor!r})")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CheckpointError(
                    f"{path} is unreadable (truncated or corrupted?) while reading {tensor!r}: {exc}"
                ) from exc
            self._open[name] = handle
        return handle

    def read(self, tensor: str, piece: dict[str, Any]) -> torch.Tensor:
        """The stored values of ``piece`` (an index piece of tensor ``tensor``)."""
        path = self.folder / piece["file"]
        handle = self._file(piece["file"], tensor)
        try:
            value = handle.get_tensor(piece["key"])
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read the piece {piece['key']!r} of {tensor!r}: {exc}") from exc
        if zlib.crc32(raw_bytes(value)) != piece["crc32"]:
            raise CheckpointError(f"{path}: the piece {piece['key']!r} of {tensor!r} is corrupted (CRC-32 mismatch)")
        return value


@contextmanager
def reading(folder: str | Path) -> Iterator[Reader]:
    reader = Reader(folder)
    try:
        yield reader
    finally:
        reader.close()


def fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
