"""``tessera.shutdown()`` frees every process group, so that their gloo worker threads are joined
before the interpreter exits (a thread left running can abort the process at exit), even while
the user still holds engines, models and the context."""

from __future__ import annotations

import os
import weakref

import torch

import tessera
from tessera import comm
from tessera.errors import CommError
from tessera.models import NextTokenLoss, gpt
from tessera.testing import RankPool, use_layout

KEPT: list[object] = []  # what a user script keeps at module level until it exits


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def body_train_then_shut_down() -> dict:
    """Train with DDP and with ZeRO-1 under tp2 x dp2, keep everything, shut down."""
    for layout in ({}, {"zero": {"stage": 1}}):
        config = {"parallel": {"tensor": {"size": 2}}, **layout}
        ctx = use_layout(tensor=2, config=config)
        torch.manual_seed(0)
        model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
        engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        engine.train_batch(iter([(tokens[:, :-1], tokens[:, 1:])]))
        KEPT.extend([ctx, model, engine])
    groups = [weakref.ref(g.pg) for g in ctx._groups.values() if g.pg is not None]
    running = threads()
    tessera.shutdown()
    try:
        comm.all_reduce(torch.ones(1), ctx.group("data"))
        after_shutdown = "no error"
    except CommError as exc:
        after_shutdown = str(exc)
    return {
        "groups": len(groups),
        "groups_alive": sum(ref() is not None for ref in groups),
        "threads_running": running,
        "threads_after": threads(),
        "after_shutdown": after_shutdown,
    }


def test_shutdown_frees_every_group_and_joins_their_threads():
    pool = RankPool(4, start_method="forkserver")  # its own pool: the ranks leave their process group
    try:
        results = pool.run(body_train_then_shut_down, timeout=300)
    finally:
        pool.close()
    for r in results:
        assert r["groups"] >= 2 and r["groups_alive"] == 0, r
        assert r["threads_after"] < r["threads_running"], r
        assert r["after_shutdown"].endswith("was closed by tessera.shutdown(); launch again to communicate")
