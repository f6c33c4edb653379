"""Asynchronous saves (through the public API): the values saved are those of the moment of the call, training goes on
meanwhile, and a second save (or a load) waits for the first."""

from __future__ import annotations

import torch

from tessera import checkpoint
from tessera.checkpoint import full_state_dict, load, save
from tests.unit.test_checkpoint_safety import engine_for


def batch():
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(11))
    return tokens[:, :-1], tokens[:, 1:]


def test_an_async_save_holds_the_values_of_its_call(tmp_path):
    engine = engine_for()
    at_save = full_state_dict(engine.module)
    handle = save(tmp_path / "a", engine, blocking=False)
    for _ in range(3):  # training goes on while the thread writes
        engine.train_batch(iter([batch()]))
    assert handle.wait() == tmp_path / "a" and checkpoint.is_complete(tmp_path / "a")
    other = engine_for()
    assert load(tmp_path / "a", other) == 2
    loaded = full_state_dict(other.module)
    assert all(torch.equal(at_save[k], loaded[k]) for k in at_save)
    assert not all(torch.equal(at_save[k], v) for k, v in full_state_dict(engine.module).items())


def test_a_second_save_waits_for_the_first(tmp_path):
    engine = engine_for(d_model=128, n_layers=4)
    first = save(tmp_path / "one", engine, blocking=False)
    second = save(tmp_path / "two", engine, blocking=False)
    assert first.done()  # the second call waited for it
    second.wait()
    assert checkpoint.is_complete(tmp_path / "one") and checkpoint.is_complete(tmp_path / "two")
