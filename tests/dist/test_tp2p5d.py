"""2.5D (Tesseract) tensor-parallel layers, checked against plain torch layers: one 2 x 2 grid
(depth 1, 4 ranks) and two stacked 2 x 2 grids (depth 2, 8 ranks; the parameter gradients must
be summed over depth, which only this layout can show). The bodies are the 2D test's."""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_tp2d import (
    NARROWING,
    SHAPES,
    body_classifiers,
    body_cross_entropy_2d_logits,
    body_dropout,
    body_embeddings,
    body_layer_norm,
    body_linear,
    body_linear_ledger,
    body_patch_embedding,
    body_split_gather,
    body_summa_forms,
)

# (world size, layout)
LAYOUTS = [
    pytest.param(4, dict(tensor=4, mode="2.5d", depth=1), id="depth1"),
    pytest.param(8, dict(tensor=8, mode="2.5d", depth=2), id="depth2"),
]


def _all_true(pools, world, body, *args, **kwargs):
    assert pools.run(world, body, *args, **kwargs) == [True] * world


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_torch(pools, world, layout, shape):
    _all_true(pools, world, body_linear, layout, *shape)


DEPTH2 = dict(tensor=8, mode="2.5d", depth=2)


@pytest.mark.parametrize("keep", [False, True], ids=["rebroadcast", "keep_blocks"])
@pytest.mark.parametrize("form", ["ab", "abt"])
@pytest.mark.parametrize("shape", SHAPES + NARROWING)
def test_linear_in_each_summa_form_matches_torch(pools, shape, form, keep):
    _all_true(pools, 8, body_linear, DEPTH2, *shape, form=form, keep_blocks=keep)


def test_each_linear_keeps_its_wider_side_put(pools):
    _all_true(pools, 8, body_summa_forms, DEPTH2)
    for keep in (False, True):  # hidden 16 > 8 classes: the untied head runs as C = A B^T
        _all_true(pools, 8, body_classifiers, DEPTH2, 4, 3, 16, 8, keep_blocks=keep)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
@pytest.mark.parametrize("shape", [(4, 3, 8), (6, 2, 15)])
def test_layer_norm_and_split_gather(pools, world, layout, shape):
    _all_true(pools, world, body_layer_norm, layout, *shape)
    _all_true(pools, world, body_split_gather, layout, *shape)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
@pytest.mark.parametrize("shape", [(4, 3, 16, 8), (6, 2, 51, 15)])
def test_embeddings_match_torch(pools, world, layout, shape):
    _all_true(pools, world, body_embeddings, layout, *shape)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
@pytest.mark.parametrize("shape", [(4, 3, 8, 16), (6, 2, 15, 51)])
def test_classifiers_and_losses_match_torch(pools, world, layout, shape):
    _all_true(pools, world, body_classifiers, layout, *shape)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
def test_patch_embedding_and_unsequenced_losses(pools, world, layout):
    for embed in (12, 15):
        _all_true(pools, world, body_patch_embedding, layout, 6, embed)
    _all_true(pools, world, body_cross_entropy_2d_logits, layout, 6, 51)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_ledger_matches_tesseract_formula(pools, world, layout, shape):
    # 3 (q-1) (|X| + |W|) + 2 (q-1)/q |bias| + 2 (d-1)/d (|W| + |bias|) bytes per rank
    assert len(set(pools.run(world, body_linear_ledger, layout, *shape))) == 1


def test_dropout_masks_differ_per_block_and_agree_across_data_replicas(pools):
    # 8 ranks: data 2 x (depth 1, 2 x 2 grid); ranks t and 4 + t hold the same block of two replicas
    results = pools.run(8, body_dropout, dict(tensor=4, mode="2.5d", depth=1, data=2))
    masks = [m for m, _ in results]
    for a in range(8):
        for b in range(a + 1, 8):
            assert torch.equal(masks[a], masks[b]) == (a % 4 == b % 4), (a, b)
    assert all(torch.equal(after, results[0][1]) for _, after in results)
