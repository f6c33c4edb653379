"""The disk tier's folders: each store has its own and removes it however it ends (closed,
dropped, at exit); a new store removes what killed runs of this host left in the same
``offload_dir``, and nothing else."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys

import torch

from tessera.memory.disk import DiskIO, remove_stale_folders


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def left_by_a_run(root, name: str, host: str | None = None) -> None:
    """A rank folder as a store writes it: its host marker and a store folder of chunk files."""
    store = root / name / "store-x"
    store.mkdir(parents=True)
    (store / "chunk0.params.bin").write_bytes(b"\0" * 64)
    if host is not None:
        (root / name / "host").write_text(host)


def test_a_new_store_removes_what_a_killed_run_of_this_host_left_and_nothing_else(tmp_path):
    here, dead = socket.gethostname(), dead_pid()
    left_by_a_run(tmp_path, f"rank0-{dead}", here)  # removed: this host's, its process ended
    left_by_a_run(tmp_path, f"rank1-{dead}", here)
    kept = {
        f"rank0-{os.getppid()}": here,  # its process runs
        f"rank2-{os.getpid()}": here,  # this process's own
        f"rank3-{dead}": "another-host",  # a shared disk: that pid means nothing here
        f"rank4-{dead}x": here,  # not the pattern
        f"backup-rank0-{dead}": here,
    }
    for name, host in kept.items():
        left_by_a_run(tmp_path, name, host)
    left_by_a_run(tmp_path, f"rank5-{dead}")  # no marker: who made it is unknown
    (tmp_path / f"rank6-{dead}").write_text("a file, not a folder")
    (tmp_path / "notes.txt").write_text("the user's")
    disk = DiskIO(tmp_path, rank=0)
    names = {p.name for p in tmp_path.iterdir()}
    assert f"rank0-{dead}" not in names and f"rank1-{dead}" not in names
    assert set(kept) | {f"rank5-{dead}", f"rank6-{dead}", "notes.txt", f"rank0-{os.getpid()}"} == names
    disk.close()
    assert remove_stale_folders(tmp_path) == []  # the rest is not a killed run's


def test_two_stores_of_one_process_keep_their_files_apart(tmp_path):
    first, second = DiskIO(tmp_path, rank=0), DiskIO(tmp_path, rank=0)
    assert first.folder != second.folder and first.folder.parent == second.folder.parent
    value = torch.arange(16, dtype=torch.float32)
    first.write("chunk0", value).wait()
    second.write("chunk0", value * 2).wait()
    first.close()
    back = torch.empty(16)
    second.read("chunk0", back).wait()
    assert torch.equal(back, value * 2), "closing one store leaves the other's files"
    second.close()
    assert list(tmp_path.iterdir()) == [], "the last store of the process removes the rank folder"


def test_a_store_dropped_without_close_removes_its_files(tmp_path):
    disk = DiskIO(tmp_path, rank=0)
    disk.write("chunk0", torch.ones(8)).wait()
    disk = None
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_script_that_raises_leaves_no_files(tmp_path):
    script = (
        "import sys, torch\n"
        "from tessera.memory.disk import DiskIO\n"
        "disk = DiskIO(sys.argv[1], rank=0)\n"
        "disk.write('chunk0', torch.ones(8)).wait()\n"
        "raise RuntimeError('the training failed')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "the training failed" in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []
