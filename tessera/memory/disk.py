"""The disk tier: one file per chunk part in an offload folder, written and read by background
threads with a bounded number of transfers in flight.

Each part is written and read whole, in one large sequential call into (or straight out of) its
host buffer: no intermediate copy, no small writes. A transfer returns a :class:`Transfer` to
wait on; its error (a full disk, a folder that became unwritable) is raised by ``wait()`` as an
:class:`~tessera.memory.tiers.OffloadError` naming the folder. Files live in a folder of their
own per store, inside one per rank and process (``<offload_dir>/rank<k>-<pid>/store-*``), and are
removed when the store closes, when it is collected unclosed, or at the interpreter's exit. A
killed run cannot remove its files: the next store made over the same ``offload_dir`` removes
every ``rank<k>-<pid>`` folder that this host made for a process that no longer runs.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tessera.memory.tiers import OffloadError


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """The buffer's memory as writable bytes (no copy), whatever its dtype."""
    flat = buffer.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class Transfer:
    """A disk read or write in flight; ``wait()`` returns when it is done (raising its error)."""

    __slots__ = ("_future", "_io", "path")

    def __init__(self, future: Future[None], io: DiskIO, path: Path) -> None:
        self._future = future
        self._io = io
        self.path = path

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        try:
            self._future.result()
        except OSError as error:
            raise self._io.explain(error, self.path) from error


class DiskIO:
    """Files of chunk parts in this store's own folder under ``folder`` (made if missing; what
    killed runs left there is removed first), written and read by ``threads`` background
    threads, at most ``in_flight`` transfers queued or running at once (a new one waits for a
    slot)."""

    def __init__(self, folder: str | os.PathLike[str], rank: int, *, threads: int = 2, in_flight: int = 4) -> None:
        self.root = Path(folder)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_folders(self.root)
            self.folder = _store_folder(self.root / f"rank{rank}-{os.getpid()}")
            # the files go also when the store is dropped unclosed, or at exit (a script that raised)
            self._remove_files = weakref.finalize(self, _remove_store, self.folder, os.getpid())
            probe = self.folder / ".probe"
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as error:
            raise OffloadError(
                f"gemini.offload_dir={str(folder)!r} cannot be used for the disk tier: {error.strerror or error}. "
                "Give a folder this process can create and write, on a disk with room for the offloaded state"
            ) from error
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tessera-disk")
        self._slots = threading.BoundedSemaphore(in_flight)
        self.bytes_written = 0
        self.bytes_read = 0
        self._closed = False

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.folder).free

    def check_room(self, nbytes: int) -> None:
        """Fail now, naming both sizes, when the disk has less than ``nbytes`` free."""
        free = self.free_bytes()
        if free < nbytes:
            raise OffloadError(
                f"gemini.offload_dir={str(self.root)!r}: the disk tier needs {nbytes / 2**20:.1f} MiB but the disk "
                f"has {free / 2**20:.1f} MiB free; free space there, give another folder, or raise "
                "gemini.host_budget / gemini.device_budget so that less goes to disk"
            )

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.bin"

    def write(self, name: str, buffer: torch.Tensor) -> Transfer:
        """Start writing ``buffer`` (a contiguous host tensor, unchanged until the write is
        done) to ``name``'s file."""
        return self._submit(self._write, name, buffer)

    def read(self, name: str, buffer: torch.Tensor) -> Transfer:
        """Start reading ``name``'s file into ``buffer`` (a contiguous host tensor of the
        file's size)."""
        return self._submit(self._read, name, buffer)

    def remove(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def _submit(self, work: object, name: str, buffer: torch.Tensor) -> Transfer:
        if self._closed:
            raise OffloadError(f"the disk tier at {self.folder} is closed")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("disk transfers take contiguous host tensors")
        self._slots.acquire()
        path = self.path(name)

        def run() -> None:
            try:
                work(path, buffer)  # type: ignore[operator]
            finally:
                self._slots.release()

        try:
            future = self._pool.submit(run)
        except BaseException:
            self._slots.release()
            raise
        return Transfer(future, self, path)

    def _write(self, path: Path, buffer: torch.Tensor) -> None:
        data = _bytes_of(buffer)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        self.bytes_written += len(data)

    def _read(self, path: Path, buffer: torch.Tensor) -> None:
        data = _bytes_of(buffer)
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(data):
                got = os.preadv(fd, [data[done:]], done)
                if got == 0:
                    raise OSError(errno.EIO, f"{path} ends after {done} of {len(data)} bytes")
                done += got
        finally:
            os.close(fd)
        self.bytes_read += len(data)

    def explain(self, error: OSError, path: Path) -> OffloadError:
        """An OffloadError saying what went wrong with the disk tier, in the user's terms."""
        if error.errno == errno.ENOSPC:
            why = "the disk is full"
            fix = "free space there, give another folder, or raise gemini.host_budget so that less goes to disk"
        elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            why = "it cannot be written"
            fix = "give a folder this process can write"
        else:
            why = error.strerror or str(error)
            fix = "check the disk"
        return OffloadError(f"gemini.offload_dir={str(self.root)!r}: {path.name}: {why}; {fix}")

    def close(self) -> None:
        """Wait for the transfers in flight and remove this store's files."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._remove_files()


# ---- the folders: one per rank and process, one per store inside it ------------------------

_RANK_FOLDER = re.compile(r"rank(\d+)-(\d+)")  # rank<k>-<pid>, the whole name
_HOST_FILE = "host"  # in a rank folder: the host whose process made it


def _store_folder(rank_folder: Path) -> Path:
    """A new folder for one store inside ``rank_folder`` (made if missing, marked with this
    host's name), so that two stores of one process never share files."""
    for _ in range(3):  # a store of this process closing at once may remove the emptied rank folder
        try:
            rank_folder.mkdir(exist_ok=True)
            marker = rank_folder / _HOST_FILE
            if not marker.exists():
                marker.write_text(socket.gethostname())
            return Path(tempfile.mkdtemp(prefix="store-", dir=rank_folder))
        except FileNotFoundError:
            continue
    raise FileNotFoundError(errno.ENOENT, "the folder was removed while it was being made", str(rank_folder))


def _remove_store(folder: Path, owner: int) -> None:
    """Remove a store's folder, and its rank folder once no other store of the process uses it
    (only in the process ``owner`` that made it: a forked child exiting leaves them)."""
    if os.getpid() != owner:
        return
    shutil.rmtree(folder, ignore_errors=True)
    rank_folder = folder.parent
    try:
        if any(entry.name != _HOST_FILE for entry in rank_folder.iterdir()):
            return
        (rank_folder / _HOST_FILE).unlink(missing_ok=True)
        rank_folder.rmdir()
    except OSError:
        pass  # gone already, or another store of this process began meanwhile


def remove_stale_folders(root: Path) -> list[Path]:
    """Remove the folders under ``root`` that a killed run left: each ``rank<k>-<pid>`` folder
    made on this host (its marker says so) by a process that is not running. Folders of running
    processes, of other hosts (a shared disk), of this process, and anything else are kept.
    Returns the folders removed."""
    removed = []
    for entry in root.iterdir():
        match = _RANK_FOLDER.fullmatch(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or _alive(pid) or not _made_here(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _made_here(rank_folder: Path) -> bool:
    try:
        return (rank_folder / _HOST_FILE).read_text() == socket.gethostname()
    except OSError:
        return False  # no marker: made elsewhere, or by a process killed while making it


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: a process that answers is taken as running
    return stat.rpartition(")")[2].split()[0] != "Z"


__all__ = ["DiskIO", "Transfer", "remove_stale_folders"]
