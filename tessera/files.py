"""Writing files atomically, with the permissions the user's umask gives.

Every file tessera writes whole (weights, configs, plots, benchmark rows) goes through
:func:`atomic_path`: the bytes go to a temporary file in the same folder, are flushed to disk,
get mode ``0o666 & ~umask`` (what ``open()`` would give; ``mkstemp`` alone gives 0600, which
hides the file from the user's group on a shared cluster), and are renamed over the target in
one step. A reader sees the old file or the new one, never half of one; a write that fails
leaves the old file as it was and no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Linux reports the umask here (since 4.7); reading it changes nothing.
PROC_STATUS = Path("/proc/self/status")


def current_umask() -> int:
    """The process's umask: from :data:`PROC_STATUS` where the system reports it; elsewhere set
    (to the strict 077) and restored at once, which another thread creating a file at that
    instant would see."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode a new file gets from ``open()`` under the current umask (0644 under 022)."""
    return 0o666 & ~current_umask()


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms cannot open a folder; the rename is still atomic
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends normally, the file written
    there replaces ``path`` atomically with the umask's mode. On any exception it is removed
    and ``path`` is untouched.

    The temporary name is hidden (a leading dot) and keeps ``path``'s suffix, for writers that
    choose a format by it (``matplotlib``'s ``savefig``).
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync_path(tmp)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent, directory=True)


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through :func:`atomic_path`; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return path
