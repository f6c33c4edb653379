"""The tensor modes as one family: one registry entry per validated mode, the same signatures in
every entry, and the layering (tessera.parallel below tessera.nn, the current context read only
in tessera.nn)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import torch
from torch import nn

import tessera
from tessera import nn as tnn
from tessera.context.dims import TENSOR_MODES
from tessera.parallel.tensor import tp2d
from tessera.parallel.tensor.mode import TensorMode
from tessera.parallel.tensor.modes import MODES, SINGLE_RANK, mode_of

PACKAGE = Path(tessera.__file__).parent


def test_the_registry_has_exactly_the_validated_modes():
    assert tuple(MODES) == TENSOR_MODES
    assert all(mode.name == name for name, mode in MODES.items())
    assert mode_of(None) is SINGLE_RANK


def test_every_entry_has_the_same_signature_in_every_mode():
    entries = [f.name for f in dataclasses.fields(TensorMode) if f.name not in ("name", "classes")]
    for entry in entries:
        signatures = {
            name: inspect.signature(getattr(mode, entry)) for name, mode in {**MODES, "single": SINGLE_RANK}.items()
        }
        params = {
            name: [(p.name, p.kind, p.default) for p in sig.parameters.values()] for name, sig in signatures.items()
        }
        first = params["1d"]
        assert all(p == first for p in params.values()), (entry, params)


def test_explicit_classes_of_tessera_nn_subclass_the_mode_classes():
    for mode in MODES.values():
        for cls in mode.classes:
            exported = getattr(tnn, cls.__name__)
            assert issubclass(exported, cls) and exported.__name__ == cls.__name__
    assert issubclass(tnn.Linear2D, tp2d.Linear2D)


def test_without_a_context_batch_parts_is_one():
    assert tnn.batch_parts() == 1
    assert type(tnn.PatchEmbedding(8, 4, 3, 6)) is not nn.Module
    x = torch.randn(2, 3, 4)
    assert tnn.enter_sequence_parallel(x) is x and tnn.exit_sequence_parallel(x) is x


def _sources(folder: Path) -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in sorted(folder.rglob("*.py"))]


def test_tessera_parallel_does_not_import_tessera_nn_nor_read_the_current_context():
    for path, text in _sources(PACKAGE / "parallel"):
        assert "from tessera.nn" not in text and "from tessera import nn" not in text, path
        assert "get_context" not in text and "has_context" not in text and "importlib" not in text, path


def test_tessera_nn_has_no_per_mode_branches():
    for path, text in _sources(PACKAGE / "nn"):
        assert "tensor_mode ==" not in text and "importlib" not in text, path


def test_tensor_modules_fit_on_a_few_screens():
    for path, text in _sources(PACKAGE / "parallel" / "tensor") + _sources(PACKAGE / "nn"):
        assert len(text.splitlines()) <= 400, path
