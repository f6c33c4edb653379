"""Asynchronous saves on 2 ranks (data-parallel replicas sharing the writing, and ZeRO-3
pieces): each holds the values of its call while training goes on, also when the ranks keep
their share of the save from the previous one."""

from __future__ import annotations

import pytest
import torch

from tessera import comm
from tessera.checkpoint import full_state_dict, load, planning, read_index, save
from tests.dist.test_checkpoint_resume import BUCKET_MB, setup

LAYOUTS = {
    "dp2": {"parallel": {"data": 2}},
    "zero3-dp2": {"parallel": {"data": 2}, "zero": {"stage": 3, "chunk_mb": BUCKET_MB}},
}


def save_while_training(config: dict, root: str):
    engine, loader, scheduler = setup(config, dropout=0.0)
    it = iter(loader)
    states = []
    exchanges = []
    real_exchange = planning.exchange
    planning.exchange = lambda *args: exchanges.append(1) or real_exchange(*args)  # type: ignore[assignment]
    try:
        for n in range(3):
            engine.train_batch(it)
            scheduler.step()
            states.append(full_state_dict(engine.model))
            handle = save(f"{root}/s{n}", engine, blocking=False)
            engine.train_batch(it)  # while the files are written
            handle.wait()
    finally:
        planning.exchange = real_exchange  # type: ignore[assignment]
    loaded = []
    for n in range(3):
        other, _, _ = setup(config, dropout=0.0)
        load(f"{root}/s{n}", other)
        loaded.append(full_state_dict(other.model))
    kept = planning._kept[0].staging is not None
    return (states, loaded, kept, len(exchanges)) if engine.ctx.rank == 0 else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_asynchronous_saves_hold_the_values_of_their_call(pools, tmp_path, layout):
    states, loaded, kept, exchanges = pools.run(2, save_while_training, LAYOUTS[layout], str(tmp_path), timeout=300)[0]
    assert kept and exchanges <= 1  # the later saves keep the first one's plan
    for expected, got in zip(states, loaded):
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])  # training moved on


def one_rank_changes(root: str):
    """Two asynchronous saves under dp2; before the second, one rank's pieces change (a random
    stream of its own appears) while the other's stay: each decides alone what to copy, and the
    writers plan again among the ranks that copied each piece."""
    engine, loader, scheduler = setup(LAYOUTS["dp2"], dropout=0.0)
    it = iter(loader)
    states, exchanges = [], []
    real_exchange = planning.exchange
    planning.exchange = lambda *args: exchanges.append(1) or real_exchange(*args)  # type: ignore[assignment]
    try:
        for n in range(3):
            engine.train_batch(it)
            if n == 2 and engine.ctx.rank == 1:
                with engine.ctx.rng.fork("tensor", "data"):
                    torch.rand(3)
            states.append(full_state_dict(engine.model))
            save(f"{root}/s{n}", engine, blocking=False).wait()
    finally:
        planning.exchange = real_exchange  # type: ignore[assignment]
    loaded = []
    for n in range(3):
        other, _, _ = setup(LAYOUTS["dp2"], dropout=0.0)
        load(f"{root}/s{n}", other)
        loaded.append(full_state_dict(other.model))
    return states, loaded, len(exchanges)


def test_a_rank_whose_pieces_changed_alone_still_saves_everything(pools, tmp_path):
    for states, loaded, exchanges in pools.run(2, one_rank_changes, str(tmp_path), timeout=300):
        assert exchanges == 2  # the first save's plan, and the plan among the copies of the third
        for expected, got in zip(states, loaded):
            assert all(torch.equal(got[key], expected[key]) for key in expected)


def dtype_changed_in_place(root: str):
    """dp2: after a first asynchronous save, every parameter of one module becomes float64 in
    place (the same objects); each rank checks only the pieces it copies, so the change must be
    seen by whichever rank writes each of them."""
    engine, loader, _ = setup(LAYOUTS["dp2"], dropout=0.0)
    engine.train_batch(iter(loader))
    save(f"{root}/a", engine, blocking=False).wait()
    head = [m for m in engine.model.modules() if list(m.parameters(recurse=False))][-1]
    for param in head.parameters(recurse=False):
        param.data = param.data.double() + 0.25
    expected = full_state_dict(engine.model)
    save(f"{root}/b", engine, blocking=False).wait()
    comm.barrier(engine.ctx.group("world"))  # rank 0's wait() returns once the folder is complete

    index = read_index(f"{root}/b")
    other, _, _ = setup(LAYOUTS["dp2"], dropout=0.0)
    for param in [m for m in other.model.modules() if list(m.parameters(recurse=False))][-1].parameters(recurse=False):
        param.data = param.data.double()
    load(f"{root}/b", other)
    got = full_state_dict(other.model)
    names = [n for n, _ in head.named_parameters(recurse=False)]
    dtypes = {k: v["dtype"] for k, v in index["tensors"].items() if k.startswith("model/")}
    return names, dtypes, expected, got


def test_an_asynchronous_save_sees_a_dtype_changed_in_place_on_every_writer(pools, tmp_path):
    for names, dtypes, expected, got in pools.run(2, dtype_changed_in_place, str(tmp_path), timeout=300):
        changed = [k for k in dtypes if k.rsplit(".", 1)[-1] in names and dtypes[k] == "F64"]
        assert changed and all(v == "F32" for k, v in dtypes.items() if k not in changed)
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key


def rank0_cannot_make_the_folder(root: str):
    """Rank 0 makes the save's folder in the background; if it cannot, every rank's save fails
    (no rank waits for the others until the timeout)."""
    import time

    from tessera.checkpoint import CheckpointError

    engine, loader, _ = setup(LAYOUTS["dp2"], dropout=0.0)
    engine.train_batch(iter(loader))
    blocker = f"{root}/file"
    if engine.ctx.rank == 0:
        open(blocker, "w").close()  # a file where the save's parent folder should be
    start = time.monotonic()
    handle = save(f"{blocker}/ckpt", engine, blocking=False)
    try:
        handle.wait()
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return error, time.monotonic() - start


def test_a_save_whose_folder_rank0_cannot_make_fails_on_every_rank(pools, tmp_path):
    for error, seconds in pools.run(2, rank0_cannot_make_the_folder, str(tmp_path), timeout=120):
        assert error is not None and "rank(s) [0] could not take part" in error, error
        print(f"the failed save surfaced after {seconds:.2f} s")
        assert seconds < 30  # a liveness bound: it fails at once instead of waiting on rank 0
