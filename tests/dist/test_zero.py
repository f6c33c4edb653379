"""ZeRO stages 1-3 over the data axis reproduce single-process AdamW; model-state bytes and
communicated bytes per step follow the ZeRO formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.errors import ConfigError
from tessera.memory import model_state_bytes
from tessera.memory.chunks import ChunkState, IllegalTransition
from tessera.models import NextTokenLoss, gpt
from tessera.testing import tolerance, use_layout
from tests.dist.reference import adamw_reference

# a handful of AdamW steps reach every path (the first step, bias correction, accumulated states)
STEPS = 6
GLOBAL_BATCH = 8
SEQ = 16
BUCKET_MB = 0.016  # ~4k fp32 elements a chunk: the small GPT spreads over several chunks
TOL = tolerance(blocks=2, steps=STEPS)  # a run of build() against single-process AdamW


def build() -> nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_config(stage: int, data: int | None, *, tensor: int = 1, accumulation: int = 1, clip: float | None = None,
                dtype: str = "fp32", offload: str = "none", overlap: bool = True) -> dict:  # fmt: skip
    return {
        "parallel": {"data": data, "tensor": {"size": tensor, "mode": "1d"}},
        "zero": {"stage": stage, "chunk_mb": BUCKET_MB, "offload_optimizer": offload, "overlap_comm": overlap},
        "gradient_accumulation": accumulation,
        "clip_grad_norm": clip,
        "mixed_precision": {"dtype": dtype},
    }


def train(config: dict, steps: int = STEPS):
    """Train the GPT with tessera under ``config`` on every rank of the pool."""
    ctx = use_layout(tensor=config["parallel"]["tensor"]["size"], config=config)
    model = build()  # under the layout: tensor-parallel layers take their blocks of the full weights
    # eps above rounding noise: attention's key bias has an exactly-zero gradient (see test_tp_models)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    micro = GLOBAL_BATCH // (ctx.size("data") * tessera.current_config().gradient_accumulation)
    loader = DataLoader(dataset(), batch_size=micro)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(steps)]
    state = full_state_dict(engine.model)
    return losses, state if ctx.rank == 0 else None


def reference(clip: float | None = None):
    """Plain single-process PyTorch on the global batch: the answer every layout must give."""
    return adamw_reference(build, dataset(), STEPS, GLOBAL_BATCH, clip)


@pytest.fixture(scope="module")
def references():
    return {None: reference(), 0.05: reference(0.05)}


# (ranks, stage, tensor, accumulation, clip)
FP32_CASES = [
    (2, 1, 1, 1, None),
    (2, 2, 1, 2, 0.05),
    (2, 3, 1, 1, 0.05),
    (4, 1, 1, 2, 0.05),
    (4, 2, 1, 1, None),
    (4, 3, 1, 2, 0.05),
    (4, 2, 2, 1, 0.05),  # stage 2 with tp2 (1D) x dp2
    (4, 3, 2, 2, 0.05),  # stage 3 with tp2 (1D) x dp2
]


@pytest.mark.parametrize("ranks,stage,tensor,accumulation,clip", FP32_CASES)
def test_zero_reproduces_single_process_adamw(pools, references, ranks, stage, tensor, accumulation, clip):
    data = ranks // tensor
    config = make_config(stage, data, tensor=tensor, accumulation=accumulation, clip=clip)
    results = pools.run(ranks, train, config, timeout=600)
    losses, state = results[0]
    ref_losses, ref_state = references[clip]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **TOL, msg=key)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_tracks_single_process(pools, references, stage):
    losses, state = pools.run(4, train, make_config(stage, 4, dtype="bf16", clip=0.05), timeout=600)[0]
    ref_losses, ref_state = references[0.05]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    for key in ref_state:
        torch.testing.assert_close(state[key].float(), ref_state[key], rtol=2e-2, atol=2e-2, msg=key)


def test_zero_overlap_off_and_cpu_offload_give_the_same_answer(pools, references):
    for options in ({"overlap": False}, {"offload": "cpu"}):
        losses, _ = pools.run(2, train, make_config(2, 2, **options), timeout=600)[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[None][0]), **TOL)


# ---- memory and communication ----------------------------------------------------------------------


def body_accounting(stage: int, dtype: str):
    """Model-state bytes after a step and ledger bytes of one step, with P counted here."""
    config = make_config(stage, None, dtype=dtype)
    config["zero"]["chunk_mb"] = 0.05
    ctx = use_layout(config=config)
    model = build()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    x, y = dataset().tensors
    micro = [(x[:2], y[:2])]
    engine.train_batch(iter(micro))  # the first step creates Adam's states
    with comm.ledger() as led:
        engine.train_batch(iter(micro))
    moved = {op: led.bytes(op=op, axis="data") for op in ("all_gather", "reduce_scatter")}
    return n_params, model_state_bytes(model, engine.optimizer), moved, ctx.size("data")


# bytes per parameter: (parameters, gradients, optimizer states) as (replicated, sharded) pairs
FORMULAS = {
    ("bf16", 1): ((2, 0), (2, 0), (0, 12)),
    ("bf16", 2): ((2, 0), (0, 2), (0, 12)),
    ("bf16", 3): ((0, 2), (0, 2), (0, 12)),
    ("fp32", 1): ((4, 0), (4, 0), (0, 8)),
    ("fp32", 2): ((4, 0), (0, 4), (0, 8)),
    ("fp32", 3): ((0, 4), (0, 4), (0, 8)),
}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_follow_the_zero_formulas(pools, ranks, dtype, stage):
    for n_params, held, moved, n in pools.run(ranks, body_accounting, stage, dtype, timeout=300):
        assert n == ranks
        for kind, (replicated, sharded) in zip(("parameters", "gradients", "optimizer_states"), FORMULAS[dtype, stage]):
            expected = replicated * n_params + sharded * n_params / n
            assert held[kind] == pytest.approx(expected, rel=0.01), (kind, held, expected)
        # ring volumes per rank: an all-gather or a reduce-scatter of P elements moves (N-1)/N * P each
        element = 2 if dtype == "bf16" else 4
        ring = (n - 1) / n * n_params * element
        gathers = 2 if stage == 3 else 1  # stage 3 gathers in forward and again in backward
        assert moved["all_gather"] == pytest.approx(gathers * ring, rel=0.01)
        assert moved["reduce_scatter"] == pytest.approx(ring, rel=0.01)


# ---- state dicts, errors, the chunk state machine ----------------------------------------------------


def load_and_step(stage: int | None):
    """Load a full state (shifted weights) and take one SGD step; stage None: single process."""
    ctx = use_layout(config=make_config(stage, None)) if stage is not None else None
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    target = {k: v + 0.5 for k, v in full_state_dict(build()).items()}
    x, y = dataset().tensors
    if stage is None:
        load_full_state_dict(model, target)
        optimizer.zero_grad()
        NextTokenLoss()(model(x[:4]), y[:4]).backward()
        optimizer.step()
        return target, full_state_dict(model)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    load_full_state_dict(model, target)  # must reach the shards (and the masters) too
    after_load = full_state_dict(model)
    assert ctx is not None
    mine = slice(2 * ctx.local_rank("data"), 2 * ctx.local_rank("data") + 2)  # this rank's half of the batch
    engine.train_batch(iter([(x[mine], y[mine])]))
    return after_load, full_state_dict(model)


def test_load_full_state_dict_under_zero(pools):
    target, ref_after_step = load_and_step(None)
    for stage in (1, 3):
        for after_load, after_step in pools.run(2, load_and_step, stage):
            for key in target:
                assert torch.equal(after_load[key], target[key]), key
                torch.testing.assert_close(
                    after_step[key], ref_after_step[key], **tolerance(blocks=2, steps=1), msg=key
                )


def test_zero_config_errors():
    with pytest.raises(ConfigError, match="zero.stage=4"):
        tessera.config.load_config({"zero": {"stage": 4}})
    with pytest.raises(ConfigError, match="use zero.stage=1 with pipeline"):
        tessera.config.load_config({"parallel": {"pipeline": {"size": 2}}, "zero": {"stage": 3}})


def body_illegal_transition():
    ctx = use_layout(config=make_config(3, None))
    from tessera.memory.chunks import ChunkStore

    store = ChunkStore([("w", torch.arange(10.0))], ctx.group("data"), chunk_numel=100)
    chunk = store.chunks[0]
    chunk.release()
    states = [chunk.state]
    try:
        chunk.to_state(ChunkState.SHARDED)
    except IllegalTransition:
        states.append("refused")
    chunk.gather()
    return [*states, chunk.state, store.view("w").tolist()]


def test_chunk_state_machine_refuses_illegal_moves_and_round_trips(pools):
    for result in pools.run(2, body_illegal_transition):
        assert result[:3] == [ChunkState.SHARDED, "refused", ChunkState.GATHERED]
        assert result[3] == [float(i) for i in range(10)]


# ---- fp16 loss scaling, pipelines -------------------------------------------------------------------


def test_zero_fp16_tracks_single_process(pools, references):
    config = make_config(2, 2, dtype="fp16", clip=0.05)
    config["mixed_precision"]["initial_scale"] = 2.0**10
    losses, _ = pools.run(2, train, config, timeout=600)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[0.05][0]), rtol=2e-2, atol=0)


def body_overflow(stage: int):
    """fp16 ZeRO on 2 ranks: at step 3 rank 1 alone holds an inf gradient in its shard."""
    config = make_config(stage, None, dtype="fp16")
    config["mixed_precision"].update(initial_scale=1024.0, growth_interval=2)
    ctx = use_layout(config=config)
    model = build()
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
    x, y = dataset().tensors
    log = []
    for step in range(6):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[2 * step : 2 * step + 2]), y[2 * step : 2 * step + 2]))
        if step == 3 and ctx.rank == 1:
            if stage == 1:  # full gradients until the step: rank 1's inf reaches one shard's owner
                model.lm_head.weight.grad[0, 0] = float("inf")
            else:  # already reduce-scattered: only rank 1's shard holds it
                engine.optimizer.residence.grad_shards[0][0] = float("inf")
        before = full_state_dict(model)
        stepped = engine.step()
        after = full_state_dict(model)
        log.append((stepped, engine.scaler.scale, all(torch.equal(before[k], after[k]) for k in before)))
    return log


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_overflow_in_one_shard_skips_the_step_everywhere(pools, stage):
    logs = pools.run(2, body_overflow, stage)
    assert logs[0] == logs[1]
    stepped, scales, unchanged = zip(*logs[0])
    assert stepped == (True, True, True, False, True, True)
    assert unchanged == (False, False, False, True, False, False)
    assert scales == (1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0)


def train_pipeline(config: dict):
    """The GPT in 2 pipeline stages x 2 data ranks, ZeRO-1 over the data axis."""
    ctx = use_layout(pipeline=2, config=config)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    x, y = dataset().tensors
    per_rank = GLOBAL_BATCH // ctx.size("data")
    micro = per_rank // 2
    losses = []
    for step in range(STEPS):
        base = step * GLOBAL_BATCH + ctx.local_rank("data") * per_rank
        batches = [(x[base + i * micro : base + (i + 1) * micro], y[base + i * micro : base + (i + 1) * micro])
                   for i in range(2)]  # fmt: skip
        losses.append(engine.train_batch(iter(batches)))
    return losses, full_state_dict(model)


def test_zero1_with_pipeline_and_data_parallelism(pools, references):
    config = make_config(1, 2, clip=0.05)
    config["parallel"]["pipeline"] = {"size": 2, "schedule": "1f1b", "microbatches": 2}
    losses, state = pools.run(4, train_pipeline, config, timeout=600)[0]
    ref_losses, ref_state = references[0.05]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **TOL, msg=key)


# ---- LAMB and LARS over ZeRO pieces -----------------------------------------------------------------


def make_large_batch_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "lamb":
        return tessera.optim.LAMB(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tessera.optim.LARS(model.parameters(), lr=0.5, weight_decay=1e-4, trust_coefficient=0.02)


def train_large_batch(name: str, stage: int | None, steps: int = STEPS):
    """LAMB/LARS on the GPT: under ZeRO on 4 data ranks, or (stage None) in this process."""
    if stage is not None:
        ctx = use_layout(config=make_config(stage, None))
    model = build()
    optimizer = make_large_batch_optimizer(name, model)
    x, y = dataset().tensors
    if stage is None:
        for step in range(steps):
            sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
            optimizer.zero_grad()
            NextTokenLoss()(model(x[sl]), y[sl]).backward()
            optimizer.step()
        return full_state_dict(model)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    per_rank = GLOBAL_BATCH // ctx.size("data")
    for step in range(steps):
        start = step * GLOBAL_BATCH + ctx.local_rank("data") * per_rank
        engine.train_batch(iter([(x[start : start + per_rank], y[start : start + per_rank])]))
    return full_state_dict(model)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_under_zero2_match_single_process(pools, name):
    expected = train_large_batch(name, None)
    for state in pools.run(4, train_large_batch, name, 2, timeout=600):
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], **tolerance(blocks=2, steps=STEPS), msg=key)


def body_offload_setup(stage: int):
    """With offload, AdamW steps as HostAdamW on host tensors, and a scheduler built on the
    user's optimizer before initialize still sets the learning rate that is used."""
    use_layout(config=make_config(stage, None, dtype="bf16", offload="cpu"))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0 if step >= 1 else 1.0)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    inner = engine.optimizer.optimizer
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    x, y = dataset().tensors
    engine.train_batch(iter([(x[:2], y[:2])]))
    scheduler.step()  # lr 0 from now on: the weights must stop changing
    before = full_state_dict(model)
    engine.train_batch(iter([(x[2:4], y[2:4])]))
    after = full_state_dict(model)
    frozen = all(torch.equal(before[k], after[k]) for k in before)
    return type(inner).__name__, {p.device.type for p in pieces}, {p.dtype for p in pieces}, frozen


def test_cpu_offload_uses_host_adamw_and_follows_the_scheduler(pools):
    for stage in (2, 3):
        for name, devices, dtypes, frozen in pools.run(2, body_offload_setup, stage):
            assert (name, devices, dtypes, frozen) == ("HostAdamW", {"cpu"}, {torch.float32}, True)


def tiny_lamb_run(stage: int | None):
    """A 3-parameter model on 4 ranks: two ranks' shards are all padding, yet clipping and
    LAMB's norms (collectives over the data axis) must still meet on every rank."""
    ctx = use_layout(config=make_config(stage, None, clip=0.1)) if stage is not None else None
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = tessera.optim.LAMB(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5 * 8, 2, generator=g), torch.randn(5 * 8, 1, generator=g)
    if ctx is None:
        for step in range(5):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[8 * step : 8 * step + 8]), y[8 * step : 8 * step + 8]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
        return model.state_dict()
    engine, *_ = tessera.initialize(model, optimizer, nn.MSELoss())
    rank = ctx.local_rank("data")
    for step in range(5):
        start = 8 * step + 2 * rank
        engine.train_batch(iter([(x[start : start + 2], y[start : start + 2])]))
    return full_state_dict(model)


def test_ranks_holding_only_padding_still_join_every_norm(pools):
    expected = tiny_lamb_run(None)
    for stage in (1, 2, 3):
        for state in pools.run(4, tiny_lamb_run, stage, timeout=120):
            for key in expected:
                # a linear layer, the loss and LAMB's norms: about one block's depth a pass
                torch.testing.assert_close(state[key], expected[key], **tolerance(steps=5), msg=(stage, key))
