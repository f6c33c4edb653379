"""tessera.nn without a tensor group is plain torch; the explicit classes resolve by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera import nn as tnn
from tessera.nn.explicit import tp1d, tp2d, tp2p5d, tp3d


def test_without_a_tensor_group_the_layers_are_plain_torch():
    assert type(tnn.Linear(4, 3)) is nn.Linear
    assert type(tnn.Linear(4, 3, input_is_parallel=True)) is nn.Linear
    assert type(tnn.LayerNorm(4)) is nn.LayerNorm
    assert type(tnn.Embedding(10, 4)) is nn.Embedding
    assert type(tnn.VocabParallelEmbedding(10, 4)) is nn.Embedding
    assert type(tnn.Dropout(0.1)) is nn.Dropout
    emb = nn.Embedding(10, 4)
    head = tnn.VocabParallelClassifier(4, 10, weight=emb.weight)
    assert head.weight is emb.weight
    logits, targets = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    expected = nn.functional.cross_entropy(logits.reshape(6, 10), targets.reshape(6))
    assert torch.equal(tnn.CrossEntropyLoss()(logits, targets), expected)
    x = torch.randn(2, 3, 4)
    assert tnn.split_activation(x) is x and tnn.gather_activation(x) is x and tnn.hidden_parts() == 1


@pytest.mark.parametrize(
    ("name", "module"),
    [("Linear1D_Col", tp1d), ("Linear1D_Row", tp1d), ("Linear2D", tp2d), ("LayerNorm2D", tp2d),
     ("Linear2p5D", tp2p5d), ("VocabParallelEmbedding2p5D", tp2p5d), ("Linear3D", tp3d), ("PatchEmbedding3D", tp3d)],
)  # fmt: skip
def test_explicit_classes_resolve_to_their_mode_module(name, module):
    assert getattr(tnn, name) is getattr(module, name)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="Linear4D"):
        tnn.Linear4D  # noqa: B018
