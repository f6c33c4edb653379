"""Asynchronous saves hold the values of the moment of the call, whatever training does while
the files are written; a rank keeps its share of the save (the plan and the host buffer) for
the next save of the same tensors and plans anew when they change."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import (
    CheckpointError,
    consolidate,
    full_state_dict,
    holding,
    load,
    planning,
    read_index,
    save,
    sharded,
)
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
    real_exchange = planning.exchange
    monkeypatch.setattr(planning, "exchange", lambda *args: exchanges.append(1) or real_exchange(*args))
    monkeypatch.setattr(planning, "_kept", [])
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
            buffer = planning._kept[0].staging.buffer.data_ptr()
    assert len(exchanges) == 1, "the plan is made once and kept while the same tensors are saved"
    assert planning._kept[0].staging.buffer.data_ptr() == buffer, "the host buffer is reused"
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


def test_a_kept_listing_is_listed_anew_when_a_tensor_changes():
    engine = engine_for()
    holding.holding(engine)
    assert holding.holding(engine).kept, "saving the same tensors again lists nothing anew"
    optimizer = engine.strategy.optimizer
    param = next(iter(optimizer.state))
    optimizer.state[param]["exp_avg"] = optimizer.state[param]["exp_avg"].clone()  # a state replaced
    assert not holding.holding(engine).kept and holding.holding(engine).kept
    engine.module.lm_head.bias = torch.nn.Parameter(torch.zeros(64))  # a parameter registered
    assert not holding.holding(engine).kept and holding.holding(engine).kept
    names = [p.name for p in holding.holding(engine).pieces]
    assert "model/lm_head.bias" in names


def test_an_asynchronous_save_sees_a_dtype_changed_in_place(tmp_path):
    engine = engine_for()
    save(tmp_path / "a", engine, blocking=False).wait()
    param = next(p for n, p in engine.module.named_parameters() if n.endswith("ln_f.weight"))
    param.data = param.data.double() + 0.5  # the same Parameter object, another dtype
    assert holding.holding(engine, check_layout=False).kept  # identities alone do not show it
    save(tmp_path / "b", engine, blocking=False).wait()
    index = read_index(tmp_path / "b")
    key = next(k for k in index["tensors"] if k.startswith("model/") and k.endswith("ln_f.weight"))
    assert index["tensors"][key]["dtype"] == "F64"
    consolidate(tmp_path / "b", tmp_path / "b.safetensors")
    assert torch.equal(load_file(tmp_path / "b.safetensors")[key.removeprefix("model/")], param.data)


def test_a_plan_among_the_ranks_that_copied_names_what_no_one_copied():
    view = {"local_shape": [4], "segments": [[[0, 0, 4]]], "flat": None}
    described = [
        [{"name": "model/a", "view": view, "nbytes": 16, "copied": True}],
        [{"name": "model/a", "view": view, "nbytes": 16, "copied": False},
         {"name": "model/b", "view": view, "nbytes": 16, "copied": False}],
    ]  # fmt: skip
    assert planning.plan(described) == {planning.plan_key("model/a", view): 0, planning.plan_key("model/b", view): 1}
    with pytest.raises(CheckpointError, match=r"1 piece\(s\) were copied by no rank that holds them \(model/b\)"):
        planning.plan(described, only_copied=True)
