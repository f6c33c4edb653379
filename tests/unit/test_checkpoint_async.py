"""Asynchronous saves hold the values of the moment of the call, whatever training does while
the files are written; a rank keeps its share of the save (the plan and the host buffer) for
the next save of the same tensors and plans anew when they change."""

from __future__ import annotations

import torch

from tessera.checkpoint import full_state_dict, load, save, sharded
from tests.unit.test_checkpoint_safety import engine_for


def bump(engine) -> None:
    """Change every tensor a save writes, in place (as training would while the files are written)."""
    with torch.no_grad():
        for t in sharded.written_share(engine):
            t.add_(1)


def loaded_state(path, **kwargs):
    other = engine_for(**kwargs)
    load(path, other)
    return full_state_dict(other.module)


def assert_equal(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def count_exchanges(monkeypatch) -> list[int]:
    """Calls of the plan's exchange from now on (nothing kept from earlier tests)."""
    exchanges: list[int] = []
    real_exchange = sharded._exchange
    monkeypatch.setattr(sharded, "_exchange", lambda data, ctx: exchanges.append(1) or real_exchange(data, ctx))
    monkeypatch.setattr(sharded, "_kept", [])
    return exchanges


def test_an_asynchronous_save_holds_the_values_of_its_call(tmp_path, monkeypatch):
    exchanges = count_exchanges(monkeypatch)
    engine = engine_for(zero=3)
    states = []
    for n in range(3):
        states.append(full_state_dict(engine.module))
        handle = save(tmp_path / f"s{n}", engine, blocking=False)
        bump(engine)  # while the files are written
        handle.wait()
        if n == 0:
            buffer = sharded._kept[0].staging.buffer.data_ptr()
    assert len(exchanges) == 1, "the plan is made once and kept while the same tensors are saved"
    assert sharded._kept[0].staging.buffer.data_ptr() == buffer, "the host buffer is reused"
    for n, expected in enumerate(states):
        assert_equal(loaded_state(tmp_path / f"s{n}", zero=3), expected)


def test_the_plan_is_made_anew_when_the_tensors_change(tmp_path, monkeypatch):
    exchanges = count_exchanges(monkeypatch)
    small, large = engine_for(), engine_for(d_model=48)
    for n, engine in enumerate([small, small, large, small]):
        expected = full_state_dict(engine.module)
        save(tmp_path / f"s{n}", engine, blocking=n % 2 == 0).wait()
        assert_equal(loaded_state(tmp_path / f"s{n}", d_model=48 if engine is large else 32), expected)
    assert len(exchanges) == 3  # small; kept; large; small again
