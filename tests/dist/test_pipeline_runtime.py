"""The pipeline runtime runs every schedule on real gloo ranks and reproduces plain PyTorch with
gradient accumulation: same losses, same weights, and the p2p bytes the schedule implies. The
zero-bubble split of a backward (B, then W) gives the gradients of one whole backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera import comm
from tessera.comm import single_rank_group
from tessera.parallel.pipeline import Action, Kind, add_p2p, build_schedule, validate
from tessera.parallel.pipeline.backward import backward_input, backward_weight
from tessera.parallel.pipeline.partition import chunk_ranges, chunks_of_rank, uniform
from tessera.parallel.pipeline.runtime import PipelineRuntime, build_chunks
from tessera.testing import tolerance, use_layout

BLOCKS = 8
WIDTH = 16
CLASSES = 4
MICRO = 8  # rows per micro-batch
STEPS = 10
LR = 0.1
BOUNDARY_BYTES = MICRO * WIDTH * 4  # one fp32 activation (or its gradient) crossing a chunk boundary
HEADER_BYTES = 8 * 8  # the int64 [8] shape header sent once per boundary
LOSS_BYTES = 8  # the step's float64 loss, riding on the last micro-batch's gradient at every boundary


def trained(steps: int) -> dict[str, float]:
    """The tolerance of make_model() (BLOCKS linear + tanh layers, about 2 roundings each a pass)
    after ``steps`` SGD steps against one process."""
    return tolerance(depth=2 * BLOCKS * (1 + 2 * steps))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    blocks[-1].append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*blocks)


def micro_batches(step: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(m, MICRO, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (m, MICRO), generator=g)
    return list(x), list(y)


def reference_run(m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole model, gradient accumulation over the same m micro-batches."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(*micro_batches(step, m)):
            loss = nn.functional.cross_entropy(model(x), y) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def body_pipeline(schedule: str, p: int, m: int, v: int, data: int):
    ctx = use_layout(pipeline=p, data=data)
    group, rank = ctx.group("pipeline"), ctx.local_rank("pipeline")
    model = make_model()
    boundaries = uniform(BLOCKS, p * v)
    chunk_ids = chunks_of_rank(rank, p, v)
    chunks = build_chunks(list(model), boundaries, chunk_ids)
    actions = build_schedule(schedule, p, m, v)[rank]
    runtime = PipelineRuntime(chunks, actions, p * v, nn.functional.cross_entropy, group)
    opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
    losses, traffic = [], []
    for step in range(STEPS):
        inputs, targets = micro_batches(step, m)
        opt.zero_grad()
        with comm.ledger() as led:
            losses.append(runtime.run(inputs, targets))
        traffic.append(
            {
                op: (led.calls(op, "pipeline"), led.payload_bytes(op, "pipeline"))
                for op in ("send", "recv", "all_reduce")
            }
        )
        opt.step()
    ranges = chunk_ranges(boundaries, BLOCKS)
    mine = {k for c in chunk_ids for k in range(*ranges[c])}
    state = {k: t.clone() for k, t in model.state_dict().items() if int(k.split(".")[0]) in mine}
    sends = sum(a.kind.is_send for a in actions)
    receives = sum(a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) for a in actions)
    act_boundaries = len({(a.kind, a.chunk) for a in actions if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT)})
    carriers = {
        k: sum(a.kind is k and a.microbatch == m - 1 for a in actions) for k in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    }
    sent = sends * BOUNDARY_BYTES + carriers[Kind.SEND_GRAD] * LOSS_BYTES
    received = receives * BOUNDARY_BYTES + carriers[Kind.RECV_GRAD] * LOSS_BYTES
    return losses, state, traffic, (sends, receives, act_boundaries, sent, received)


CASES = [
    # (schedule, p, m, v, data)
    ("gpipe", 2, 4, 1, 1),
    ("1f1b", 2, 4, 1, 1),
    ("interleaved", 2, 4, 2, 1),
    ("zero_bubble", 2, 4, 1, 1),
    ("gpipe", 4, 4, 1, 1),
    ("1f1b", 4, 8, 1, 1),
    ("interleaved", 4, 4, 2, 1),  # 8 chunks of one block each
    ("zero_bubble", 4, 8, 1, 1),
    ("1f1b", 2, 4, 1, 2),  # pipeline inside a 2x2 layout: peers index the pipeline group
]


@pytest.mark.parametrize(("schedule", "p", "m", "v", "data"), CASES, ids=lambda c: str(c))
def test_pipeline_matches_single_process(pools, schedule, p, m, v, data):
    results = pools.run(p * data, body_pipeline, schedule, p, m, v, data)
    ref_losses, ref_state = reference_run(m)
    for losses, *_ in results:  # every pipeline rank gets the step's mean loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **trained(STEPS))
    merged: dict[str, torch.Tensor] = {}
    for _, state, _, _ in results[:p]:  # the first data replica's pipeline ranks
        assert not merged.keys() & state.keys()
        merged.update(state)
    assert merged.keys() == ref_state.keys()
    for key, expected in ref_state.items():
        torch.testing.assert_close(merged[key], expected, **trained(STEPS), msg=key)

    for _, _, traffic, (sends, receives, act_boundaries, sent, received) in results:
        first, later = traffic[0], traffic[1]
        # After the first step every transfer is one activation or gradient of [MICRO, WIDTH], the
        # last micro-batch's gradients with the loss in front; no other communication.
        assert later["send"] == (sends, sent)
        assert later["recv"] == (receives, received)
        assert later["all_reduce"] == (0, 0)  # every rank got the loss without a collective
        assert all(t == later for t in traffic[1:])
        # The first step adds one shape header per boundary this rank sends activations over, or
        # receives them from; later steps reuse the cached shapes.
        assert first["send"][0] - sends + first["recv"][0] - receives == act_boundaries > 0
        assert first["send"][1] - sent == (first["send"][0] - sends) * HEADER_BYTES
        assert first["recv"][1] - received == (first["recv"][0] - receives) * HEADER_BYTES
        assert sum(c for c, _ in first.values()) > sum(c for c, _ in later.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_middle_stage_traffic(pools, schedule):
    """A middle stage of pp4 sends m activations forward and m gradients back per step, and
    receives as many: 2 * m * (MICRO x WIDTH x 4 bytes) each way, plus the step's loss (8 bytes)
    on the last gradient in and out."""
    m = 4
    results = pools.run(4, body_pipeline, schedule, 4, m, 1, 1)
    for rank in (1, 2):
        later = results[rank][2][1]
        assert later["send"][1] == later["recv"][1] == 2 * m * BOUNDARY_BYTES + LOSS_BYTES
        first = results[rank][2][0]  # plus one header out (to the next stage) and one in (from the previous)
        assert first["send"][1] == first["recv"][1] == 2 * m * BOUNDARY_BYTES + LOSS_BYTES + HEADER_BYTES


# rows of each micro-batch, step by step: new shapes in steps 0, 1 and 3, within a step and across
UNEVEN_ROWS = [(8, 8, 8, 8), (8, 5, 8, 5), (5, 8, 5, 8), (3, 8, 3, 5)]
NEW_SHAPES = [1, 1, 0, 1]  # row counts not seen in an earlier step


def uneven_micro_batches(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2000 + step)
    rows = UNEVEN_ROWS[step]
    return [torch.randn(r, WIDTH, generator=g) for r in rows], [
        torch.randint(0, CLASSES, (r,), generator=g) for r in rows
    ]


def body_uneven(schedule: str):
    ctx = use_layout(pipeline=2)
    group, rank = ctx.group("pipeline"), ctx.local_rank("pipeline")
    model = make_model()
    chunks = build_chunks(list(model), uniform(BLOCKS, 2), [rank])
    actions = build_schedule(schedule, 2, len(UNEVEN_ROWS[0]))[rank]
    runtime = PipelineRuntime(chunks, actions, 2, None, group)  # the loss comes with each step
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, headers = [], []
    transfers = sum(not a.kind.is_compute for a in actions)
    for step in range(len(UNEVEN_ROWS)):
        opt.zero_grad()
        with comm.ledger() as led:
            losses.append(runtime.run(*uneven_micro_batches(step), loss_fn=nn.functional.cross_entropy))
        headers.append(led.calls("send", "pipeline") + led.calls("recv", "pipeline") - transfers)
        opt.step()
    mine = {k: t.clone() for k, t in model.state_dict().items() if (int(k.split(".")[0]) < BLOCKS // 2) == (rank == 0)}
    return losses, mine, headers


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_micro_batches_of_changing_shapes(pools, schedule):
    """Micro-batches whose rows change within a step and between steps (a collator's padding, a
    stream's short last batch) train as in one process; an activation's shape header crosses
    once per boundary and new input shape, in the step that first brings it."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for step in range(len(UNEVEN_ROWS)):
        opt.zero_grad()
        inputs, targets = uneven_micro_batches(step)
        loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in zip(inputs, targets, strict=True)) / len(inputs)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    merged: dict[str, torch.Tensor] = {}
    for losses, state, headers in pools.run(2, body_uneven, schedule):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **trained(len(UNEVEN_ROWS)))
        assert headers == NEW_SHAPES
        merged.update(state)
    assert merged.keys() == model.state_dict().keys()
    for key, expected in model.state_dict().items():
        torch.testing.assert_close(merged[key], expected, **trained(len(UNEVEN_ROWS)), msg=key)


def test_a_runtime_without_a_loss_function_says_so():
    chunks = build_chunks(list(make_model()), [], [0])
    runtime = PipelineRuntime(chunks, build_schedule("1f1b", 1, 2)[0], 1, None, single_rank_group("pipeline"))
    with pytest.raises(ValueError, match="no loss function"):
        runtime.run(*micro_batches(0, 2))
    assert runtime.run(*micro_batches(0, 2), loss_fn=nn.functional.cross_entropy) > 0


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_one_rank_runs_neighbouring_chunks_locally(schedule, v):
    """p = 1: chunks that neighbour on one rank hand activations and gradients over without p2p."""
    m = 4
    model = make_model()
    chunks = build_chunks(list(model), uniform(BLOCKS, v), list(range(v)))
    actions = build_schedule(schedule, 1, m, v)[0]
    runtime = PipelineRuntime(chunks, actions, v, nn.functional.cross_entropy, single_rank_group("pipeline"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(runtime.run(*micro_batches(step, m)))
        opt.step()
    ref_losses, ref_state = reference_run(m)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **trained(STEPS))
    for key, expected in ref_state.items():
        torch.testing.assert_close(model.state_dict()[key], expected, **trained(STEPS), msg=key)


def test_actions_on_a_chunk_not_held_raise():
    chunks = build_chunks(list(make_model()), uniform(BLOCKS, 2), [0])
    actions = build_schedule("1f1b", 2, 2)[1]  # rank 1's list names chunk 1
    with pytest.raises(ValueError, match=r"chunks \[1\]"):
        PipelineRuntime(chunks, actions, 2, nn.functional.cross_entropy, single_rank_group("pipeline"))


def test_a_schedule_whose_last_gradient_leaves_before_the_last_forward_raises():
    """The step's loss rides on micro-batch m-1's gradient, so the last chunk must have run every
    forward by then; a schedule that runs F(c1, m0) after BW(c1, m1) is refused up front."""
    orders = [
        [
            Action(Kind.FORWARD, 0, 1),
            Action(Kind.FORWARD, 0, 0),
            Action(Kind.BACKWARD, 0, 1),
            Action(Kind.BACKWARD, 0, 0),
        ],
        [
            Action(Kind.FORWARD, 1, 1),
            Action(Kind.BACKWARD, 1, 1),
            Action(Kind.FORWARD, 1, 0),
            Action(Kind.BACKWARD, 1, 0),
        ],
    ]
    schedule = add_p2p(orders, 2)
    validate(schedule, 2, 2)  # a valid schedule; only the loss cannot travel with it
    chunks = build_chunks(list(make_model()), uniform(BLOCKS, 2), [1])
    with pytest.raises(ValueError, match="carries the step's loss"):
        PipelineRuntime(chunks, schedule[1], 2, nn.functional.cross_entropy, single_rank_group("pipeline"))


# ---- the zero-bubble split of a chunk's backward (backward.py), one process ------------------


class _Tied(nn.Module):
    """One Linear used twice on the input path and once more off it: a parameter with several
    intermediates, one above the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (self.norm(h) + self.lin(torch.tanh(h))) * self.lin.weight.sum()


class _Residual(nn.Module):
    """A bare parameter added to the input, a residual branch, and a parameter the output does not use."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(WIDTH))
        self.up, self.down, self.unused = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x + self.pos)))


SPLIT_MODULES = {
    "mlp": lambda: nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)]),
    "layernorm": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)),
    "tied": _Tied,
    "residual": _Residual,
    "transformer": lambda: nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True),
}


@pytest.mark.parametrize("name", list(SPLIT_MODULES))
@pytest.mark.parametrize("scalar", [False, True], ids=["output", "loss"])
def test_split_backward_matches_the_whole_backward(name, scalar):
    """B then W give the input gradient and every parameter gradient of one whole backward, over
    two accumulated micro-batches; B alone touches no parameter gradient."""
    torch.manual_seed(0)
    module = SPLIT_MODULES[name]().double()
    params = list(module.parameters())
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 5, WIDTH, generator=g, dtype=torch.float64) for _ in range(2)]
    grads = [torch.randn(2, 5, WIDTH, generator=g, dtype=torch.float64) for _ in range(2)]

    def forward(x):
        x = x.clone().requires_grad_(True)
        out = module(x)
        return x, (out.pow(2).mean() if scalar else out)

    ref_x = []
    for x, grad in zip(xs, grads, strict=True):
        x, out = forward(x)
        out.backward(None if scalar else grad)
        ref_x.append(x.grad)
    ref = [None if q.grad is None else q.grad.clone() for q in params]
    module.zero_grad(set_to_none=True)

    works = []
    for x, grad, expected in zip(xs, grads, ref_x, strict=True):
        x, out = forward(x)
        x_grad, work = backward_input(out, None if scalar else grad, x, params)
        torch.testing.assert_close(x_grad, expected, rtol=1e-12, atol=1e-12)
        works.append(work)
    assert all(q.grad is None for q in params)  # B made no weight gradient
    for work in works:
        backward_weight(work)
    for q, expected in zip(params, ref, strict=True):
        if expected is None:
            assert q.grad is None
        else:
            torch.testing.assert_close(q.grad, expected, rtol=1e-12, atol=1e-12)


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _CountBackward.calls += 1
        return grad


def test_weight_pass_does_not_redo_the_input_path():
    """W starts where the parameters' branches leave the input path: the part of the backward on
    that path (here the identity between two Linears) runs once, in B."""
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    x = torch.randn(MICRO, WIDTH, requires_grad=True)
    out = second(_CountBackward.apply(first(x)))
    _CountBackward.calls = 0
    _, work = backward_input(out, torch.ones_like(out), x, [*first.parameters(), *second.parameters()])
    assert _CountBackward.calls == 1
    backward_weight(work)
    assert _CountBackward.calls == 1
    assert first.weight.grad is not None and second.weight.grad is not None
