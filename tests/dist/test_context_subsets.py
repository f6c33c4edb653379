"""Contexts over part of the job (``ParallelContext.on_ranks``), on one 4-rank pool: an engine
with ZeRO-2 over data 2 on ranks 0-1 and one with 1D tensor parallelism on ranks 2-3 train at
the same time, each to the single-process answer (fp32, 1e-5); then the two sets exchange over
the whole job, overlapping contexts reduce over their own ranks, and pipeline stages on ranks 1-2
send to each other by their ranks in the job."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict, load, save
from tessera.config import load_config
from tessera.context import ParallelContext, ParallelDims, get_context, has_context, set_context
from tessera.models import NextTokenLoss, gpt
from tessera.session import current_config, set_session
from tessera.testing import tolerance, use_layout

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 16
ACTOR = {"parallel": {"data": 2}, "zero": {"stage": 2, "chunk_mb": 0.016}}  # ranks 0-1
CRITIC = {"parallel": {"data": 1, "tensor": {"size": 2, "mode": "1d"}}}  # ranks 2-3
STAGES = {"parallel": {"data": 1, "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}}  # ranks 1-2


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, dropout=0.0)


def dataset(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def optimizer_for(role: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps above rounding noise: attention's key bias has an exactly-zero gradient (see test_tp_models)
    if role == "critic":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)


SEEDS = {"actor": 7, "critic": 8, "stages": 9}


def train(
    role: str, ctx: ParallelContext, config: dict, microbatches: int = 1, *, folder: str | None = None
) -> tuple[list[float], dict]:
    """STEPS steps of ``role``'s GPT as an engine over ``ctx`` (current while the model is built,
    so that its layers take ``ctx``'s tensor groups). With ``folder``, a checkpoint written there
    (in the background when ``ctx`` has a side group for it) loads back the same state."""
    model = build()
    micro = GLOBAL_BATCH // (ctx.size("data") * microbatches)
    loader = DataLoader(dataset(SEEDS[role]), batch_size=micro)
    engine, loader, _, _ = tessera.initialize(
        model, optimizer_for(role, model), NextTokenLoss(), loader, ctx=ctx, config=load_config(config)
    )
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    state = full_state_dict(engine)
    if folder is not None:
        save(folder, engine, blocking=role == "actor").wait()  # the critic's context has the side group
        comm.barrier(ctx.group("world"))  # rank 0's wait ends once the checkpoint is complete
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()
        load(folder, engine)
        assert all(torch.equal(v, state[k]) for k, v in full_state_dict(engine).items())
    return losses, state


def reference(role: str) -> tuple[list[float], dict]:
    """One process, the global batch each step: the answer every layout must give."""
    model = build()
    optimizer = optimizer_for(role, model)
    x, y = dataset(SEEDS[role]).tensors
    losses = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        loss = NextTokenLoss()(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, full_state_dict(model)


def job(folder: str) -> dict:
    """Every rank of the 4-rank pool: both engines, the exchange, overlapping contexts, stages."""
    before = get_context() if has_context() else None
    try:
        before_config = current_config()
    except RuntimeError:  # an earlier test's use_layout() without a config
        before_config = None
    me = torch.distributed.get_rank()
    out: dict = {}
    try:
        # every rank takes part in making both contexts; each gets its own or None
        actor = use_layout(ranks=[0, 1], data=2, config=ACTOR)  # current on 0-1
        critic_dims = ParallelDims(world_size=2, data=1, tensor=2)
        critic = ParallelContext.on_ranks([2, 3], critic_dims, side_groups=["checkpoint"])
        assert (actor is None) == (me >= 2) and (critic is None) == (me < 2)
        mine = actor if actor is not None else critic
        assert mine is not None
        out["layout"] = (mine.rank, mine.global_rank, mine.job_ranks, mine.ranks("world"), mine.coordinates)
        out["world_is_job"] = mine.group("world").pg is torch.distributed.group.WORLD
        out["alone"] = ParallelContext.alone().ranks("world")  # one rank, named by its rank in the job
        if actor is not None:
            assert get_context() is actor and current_config().parallel.data == 2
            out["actor"] = train("actor", actor, ACTOR, folder=f"{folder}/actor")
        else:
            assert critic is not None
            set_context(critic)  # the critic's layers split over its tensor group
            out["critic"] = train("critic", critic, CRITIC, folder=f"{folder}/critic")
            out["critic_blocks"] = sum(p.numel() for p in build().parameters())  # this rank's blocks

        # the two sets exchange over the whole job: the critic's losses from rank 2 to every rank
        world = use_layout()
        losses = torch.tensor(out["critic"][0] if me >= 2 else [0.0] * STEPS, dtype=torch.float64)
        out["from_rank_2"] = comm.broadcast(losses, world.group("world"), src=2).tolist()

        # overlapping contexts: [0, 1] again and [1, 2, 3], each reducing over its own ranks
        pair = ParallelContext.on_ranks([0, 1], ParallelDims(world_size=2, data=2))
        three = ParallelContext.on_ranks([1, 2, 3], ParallelDims(world_size=3, data=3))
        for name, ctx in (("pair", pair), ("three", three)):
            if ctx is not None:
                total = comm.all_reduce(torch.tensor([float(me)]), ctx.group("data"))
                first = comm.broadcast(torch.tensor([float(me)]), ctx.group("data"), src=0)
                out[name] = (ctx.rank, ctx.ranks("data"), total.item(), first.item())

        # pipeline stages on ranks 1 and 2: their sends and receives go to ranks 1 and 2 of the job
        stages = ParallelContext.on_ranks([1, 2], ParallelDims(world_size=2, data=1, pipeline=2))
        if stages is not None:
            set_context(stages)
            out["stages"] = train("stages", stages, STAGES, microbatches=2)
    finally:
        set_session(before, before_config)
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {role: reference(role) for role in SEEDS}


def assert_same_run(got: tuple[list[float], dict], want: tuple[list[float], dict]) -> None:
    losses, state = got
    ref_losses, ref_state = want
    tol = tolerance(blocks=2, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **tol, msg=key)


def test_engines_on_parts_of_the_job_train_side_by_side_to_the_single_process_answer(pools, references, tmp_path):
    results = pools.run(4, job, str(tmp_path), timeout=300)
    # each context's own world, with members named by their ranks in the job
    assert [r["layout"] for r in results] == [
        (0, 0, (0, 1), [0, 1], {"data": 0, "pipeline": 0, "sequence": 0, "tensor": 0}),
        (1, 1, (0, 1), [0, 1], {"data": 1, "pipeline": 0, "sequence": 0, "tensor": 0}),
        (0, 2, (2, 3), [2, 3], {"data": 0, "pipeline": 0, "sequence": 0, "tensor": 0}),
        (1, 3, (2, 3), [2, 3], {"data": 0, "pipeline": 0, "sequence": 0, "tensor": 1}),
    ]
    assert not any(r["world_is_job"] for r in results), "a part's world is a group of its own"
    assert [r["alone"] for r in results] == [[0], [1], [2], [3]]
    for rank in (0, 1):
        assert_same_run(results[rank]["actor"], references["actor"])
    for rank in (2, 3):
        assert_same_run(results[rank]["critic"], references["critic"])
        assert results[rank]["critic_blocks"] < sum(t.numel() for t in references["critic"][1].values())
    assert results[0]["actor"][0] != results[2]["critic"][0]
    for role in ("actor", "critic"):  # each checkpoint has the files of its own two ranks
        assert sorted(p.name for p in (tmp_path / role).glob("rank*.safetensors")) == [
            "rank00000.safetensors",
            "rank00001.safetensors",
        ]
    assert all(r["from_rank_2"] == results[2]["critic"][0] for r in results)
    assert [r.get("pair") for r in results] == [(0, [0, 1], 1.0, 0.0), (1, [0, 1], 1.0, 0.0), None, None]
    assert [r.get("three") for r in results] == [
        None,
        (0, [1, 2, 3], 6.0, 1.0),
        (1, [1, 2, 3], 6.0, 1.0),
        (2, [1, 2, 3], 6.0, 1.0),
    ]
    assert results[0].get("stages") is None and results[3].get("stages") is None
    for rank in (1, 2):
        assert_same_run(results[rank]["stages"], references["stages"])


def bad_calls() -> list[str]:
    """Refusals, raised alike on every rank before any group is made (so none waits on another)."""
    said = []
    dims2 = ParallelDims(world_size=2, data=2)
    for ranks, dims in (([1, 0], dims2), ([0, 0], dims2), ([3, 4], dims2), ([0, 1, 2], dims2)):
        with pytest.raises(ValueError) as caught:
            ParallelContext.on_ranks(ranks, dims)
        said.append(str(caught.value))
    pair = ParallelContext.on_ranks([2, 3], dims2, groups=[("data", "tensor")], side_groups=["writer"])
    if pair is not None:  # its groups are made with it: the ranks outside could not join later
        assert pair.group(("data", "tensor")).ranks == pair.side_group("writer").ranks == (2, 3)
        assert pair.side_group("writer").pg is not pair.group("world").pg
        with pytest.raises(RuntimeError, match=r"side_groups=\['checkpoint'\]"):
            pair.side_group("checkpoint")
    return said


def test_bad_rank_lists_are_refused_on_every_rank(pools):
    said = pools.run(4, bad_calls)
    assert all(s == said[0] for s in said)
    order, repeated, outside, count = said[0]
    assert "ascending order" in order and "[1, 0]" in order
    assert "[0] appear more than once" in repeated
    assert "[4] are outside the job's 4 rank(s)" in outside
    assert "3 rank(s) [0, 1, 2] given for a layout of world size 2" in count
