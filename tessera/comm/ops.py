"""Collectives and point-to-point ops: the only place tessera calls torch.distributed.

Every function takes the group it runs on, as an :class:`AxisGroup` or as an axis name that the
current parallel context resolves. A group of one rank makes every op a no-op. Each call is
recorded in the open comm ledgers and waited on under the watchdog: a call that does not
complete within the timeout raises :class:`CommTimeoutError` naming rank, op and axis, and the
ranks that did not arrive at it: every call is numbered per process group and recorded in the
launcher's key-value store (:mod:`tessera.comm.progress`), which the timed-out rank reads.
The numbering, the waits and the watchdog's timeout are :mod:`tessera.comm.tracking`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.comm.group import AxisGroup
from tessera.comm.ledger import record
from tessera.comm.progress import Entered
from tessera.comm.tracking import enter, enter_transfer, failure, is_gloo, wait_for
from tessera.errors import CommError
from tessera.graph_breaks import eager_in_compiled_code

Group = AxisGroup | str

# The flat collectives: torch 2.13 names them all_gather_single and reduce_scatter_single and keeps
# the older names as deprecated aliases of these; torch 2.12 and older have only the older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# ---- while dynamo traces ----------------------------------------------------------------------

# The collectives that compiled code calls instead (tessera.comm.traced registers them): each a
# custom op that runs the eager function below at run time, ledger and watchdog included.
_traced: dict[str, Callable[..., torch.Tensor]] = {}


def use_while_tracing(**functions: Callable[..., torch.Tensor]) -> None:
    """Install the functions that stand in for collectives while ``torch.compile`` traces."""
    _traced.update(functions)


def _tracing() -> bool:
    return bool(_traced) and torch.compiler.is_compiling()


# ---- group resolution ----------------------------------------------------------------------

_resolver: Callable[[str], AxisGroup] | None = None


def set_axis_resolver(resolver: Callable[[str], AxisGroup] | None) -> None:
    """Let axis names resolve to groups (the parallel context installs itself here)."""
    global _resolver
    _resolver = resolver


def resolve(group: Group) -> AxisGroup:
    """Turn an axis name or an AxisGroup into an AxisGroup (one still open)."""
    if isinstance(group, str):
        if _resolver is None:
            raise CommError(
                f"axis {group!r} given by name, but no parallel context is current; "
                "call tessera.launch(...) first or pass ctx.group(axis)"
            )
        group = _resolver(group)
    if not isinstance(group, AxisGroup):
        raise TypeError(f"expected an AxisGroup or an axis name, got {type(group).__name__}")
    if group.closed:
        raise CommError(f"{group} was closed by tessera.shutdown(); launch again to communicate")
    return group


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _issue(op: str, group: AxisGroup, payload: int, start: Callable[[], Any]) -> None:
    record(op, group.name, group.size, payload)
    entered = enter(op, group)
    wait_for(start(), op, group, entered)


def _reduce_op(op: str) -> Any:
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of: {', '.join([*_REDUCE_OPS, 'avg'])}")
    return _REDUCE_OPS[op]


def _check_divisible(tensor: torch.Tensor, dim: int, parts: int, what: str) -> None:
    if tensor.shape[dim] % parts != 0:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(tensor.shape)} is not divisible by the "
            f"group size {parts}; pad it first"
        )


# ---- collectives ---------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over the group in place and return it. ``op``: sum, avg, max, min, product."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    if _tracing():
        return _traced["all_reduce"](tensor, g, op)
    base = "sum" if op == "avg" else op
    reduce_op = _reduce_op(base)
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    _issue("all_reduce", g, _nbytes(buf), lambda: dist.all_reduce(buf, reduce_op, g.pg, async_op=True))
    if op == "avg":
        buf.div_(g.size)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


@eager_in_compiled_code
def all_reduce_async(tensor: torch.Tensor, group: Group) -> torch.futures.Future[torch.Tensor]:
    """Start a sum all-reduce of contiguous ``tensor`` in place; the future yields the tensor.

    For callers that overlap the reduction with compute (DDP's gradient buckets). The wait
    happens in the caller, so the process-group timeout (set from the same config value as the
    watchdog) ends a hang here.
    """
    g = resolve(group)
    if g.size == 1:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor")
    record("all_reduce", g.name, g.size, _nbytes(tensor))
    entered = enter("all_reduce", g)
    work = dist.all_reduce(tensor, dist.ReduceOp.SUM, g.pg, async_op=True)
    assert work is not None

    def result(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            return fut.value()[0]
        except RuntimeError as exc:  # torch hands the caller this error inside its own RuntimeError
            raise failure(exc, "all_reduce", g, entered, "the process-group timeout") from exc

    return work.get_future().then(result)


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim``: [.., n, ..] -> [.., P*n, ..].

    Members must hold equal shapes (gloo cannot gather uneven sizes: pad first).
    """
    g = resolve(group)
    if g.size == 1:
        return tensor
    if _tracing():
        return _traced["all_gather"](tensor, g, dim)
    local = tensor.movedim(dim, 0).contiguous()
    out = local.new_empty((g.size * local.shape[0], *local.shape[1:]))
    _issue("all_gather", g, _nbytes(out), lambda: _all_gather_single(out, local, g.pg, async_op=True))
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Sum over the group, keep this member's part along ``dim``: [.., P*n, ..] -> [.., n, ..]."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    _check_divisible(tensor, dim, g.size, "reduce_scatter")
    if _tracing():
        return _traced["reduce_scatter"](tensor, g, dim, op)
    base = "sum" if op == "avg" else op
    reduce_op = _reduce_op(base)
    full = tensor.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // g.size, *full.shape[1:]))
    _issue(
        "reduce_scatter",
        g,
        _nbytes(full),
        lambda: _reduce_scatter_single(out, full, reduce_op, g.pg, async_op=True),
    )
    if op == "avg":
        out.div_(g.size)
    return out.movedim(0, dim)


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Copy member ``src``'s tensor (``src`` indexes the group) to every member, in place."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    if _tracing():
        return _traced["broadcast"](tensor, g, src)
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    root = g.global_rank_of(src)
    _issue("broadcast", g, _nbytes(buf), lambda: dist.broadcast(buf, root, g.pg, async_op=True))
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


class Pending:
    """A collective in flight: ``wait()`` (under the watchdog) returns its result tensor."""

    def __init__(
        self, work: Any, op: str, group: AxisGroup, result: torch.Tensor, entered: Entered | None = None
    ) -> None:
        self._work, self._op, self._group, self._result = work, op, group, result
        self._entered = entered

    @eager_in_compiled_code
    def wait(self) -> torch.Tensor:
        if self._work is not None:
            wait_for(self._work, self._op, self._group, self._entered)
            self._work = None
        return self._result


@eager_in_compiled_code
def broadcast_async(tensor: torch.Tensor, group: Group, src: int = 0) -> Pending:
    """Start a broadcast from member ``src`` into contiguous ``tensor`` and return at once, so
    that compute can overlap it; ``.wait()`` before reading the tensor."""
    g = resolve(group)
    if g.size == 1:
        return Pending(None, "broadcast", g, tensor)
    if not tensor.is_contiguous():
        raise ValueError("broadcast_async needs a contiguous tensor")
    record("broadcast", g.name, g.size, _nbytes(tensor))
    entered = enter("broadcast", g)
    work = dist.broadcast(tensor, g.global_rank_of(src), g.pg, async_op=True)
    return Pending(work, "broadcast", g, tensor, entered)


def reduce(tensor: torch.Tensor, group: Group, dst: int = 0, op: str = "sum") -> torch.Tensor:
    """Reduce onto member ``dst`` (an index in the group), in place; other members' values are undefined."""
    g = resolve(group)
    if g.size == 1:
        return tensor
    if _tracing():
        return _traced["reduce"](tensor, g, dst, op)
    reduce_op = _reduce_op(op)
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    root = g.global_rank_of(dst)
    _issue("reduce", g, _nbytes(buf), lambda: dist.reduce(buf, root, reduce_op, g.pg, async_op=True))
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def all_to_all(tensor: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``tensor`` along ``scatter_dim`` into P parts, send part i to member i, and join the
    parts received along ``gather_dim``: [.., P*a, .., b, ..] -> [.., a, .., P*b, ..].
    """
    g = resolve(group)
    if g.size == 1:
        return tensor
    _check_divisible(tensor, scatter_dim, g.size, "all_to_all")
    if _tracing():
        return _traced["all_to_all"](tensor, g, scatter_dim, gather_dim)
    send = tensor.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    _issue("all_to_all", g, _nbytes(send), lambda: dist.all_to_all_single(recv, send, group=g.pg, async_op=True))
    parts = [p.movedim(0, scatter_dim) for p in recv.chunk(g.size, dim=0)]
    return torch.cat(parts, dim=gather_dim)


@eager_in_compiled_code
def barrier(group: Group) -> None:
    """Wait until every member arrives (under the watchdog)."""
    g = resolve(group)
    if g.size == 1:
        return
    _issue("barrier", g, 0, lambda: dist.barrier(g.pg, async_op=True))


@eager_in_compiled_code
def broadcast_object(obj: Any, group: Group, src: int = 0) -> Any:
    """Send a picklable object from member ``src`` to every member and return it."""
    g = resolve(group)
    if g.size == 1:
        return obj
    box = [obj]
    record("broadcast", g.name, g.size, 0)
    entered = enter("broadcast", g)
    try:  # waits inside torch, under the process-group timeout
        dist.broadcast_object_list(box, src=g.global_rank_of(src), group=g.pg)
    except RuntimeError as exc:
        raise failure(exc, "broadcast", g, entered, "the process-group timeout") from exc
    return box[0]


@eager_in_compiled_code
def all_gather_object(obj: Any, group: Group) -> list[Any]:
    """Every member's picklable ``obj``, in member order."""
    g = resolve(group)
    if g.size == 1:
        return [obj]
    out: list[Any] = [None] * g.size
    record("all_gather", g.name, g.size, 0)
    entered = enter("all_gather", g)
    try:  # waits inside torch, under the process-group timeout
        dist.all_gather_object(out, obj, group=g.pg)
    except RuntimeError as exc:
        raise failure(exc, "all_gather", g, entered, "the process-group timeout") from exc
    return out


# ---- point to point ------------------------------------------------------------------------


@dataclass(frozen=True)
class P2POp:
    """One half of a point-to-point transfer: ``kind`` is "send" or "recv"; ``peer`` indexes the group."""

    kind: str
    tensor: torch.Tensor
    group: Group
    peer: int


def send(tensor: torch.Tensor, group: Group, dst: int) -> None:
    """Send ``tensor`` to member ``dst`` of the group."""
    batch_p2p([P2POp("send", tensor, group, dst)])


def recv(tensor: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    """Receive into ``tensor`` from member ``src`` of the group and return it."""
    batch_p2p([P2POp("recv", tensor, group, src)])
    return tensor


def p2p_in_any_order(group: Group) -> bool:
    """Whether transfers on ``group`` complete independently of each other, so that a caller may
    post receives ahead of sends it posts later (gloo: a transfer completes once its partner is
    posted). Not with NCCL, which runs the transfers between two ranks one after another in
    posting order: an early receive holds up every later send to that rank until it is matched."""
    g = resolve(group)
    return g.size == 1 or is_gloo(g)


@eager_in_compiled_code
def batch_p2p(ops: Sequence[P2POp], *, async_op: bool = False) -> list[Pending]:
    """Issue several sends and receives together, in order; wait for all of them unless ``async_op``.

    Tensors must be contiguous (gloo cannot send strided views); receive buffers are filled in
    place. Returns one :class:`Pending` per op, in order (already complete unless ``async_op``):
    with ``async_op`` the caller waits for each (under the watchdog) before reading a receive
    buffer or reusing a send buffer, so that compute can run while the transfers travel.
    """
    if not ops:
        return []
    issued: list[tuple[P2POp, AxisGroup, int, Entered]] = []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp kind must be 'send' or 'recv', got {op.kind!r}")
        if not op.tensor.is_contiguous():
            raise ValueError(f"{op.kind} needs a contiguous tensor; call .contiguous() first")
        g = resolve(op.group)
        if g.size == 1:
            raise ValueError(f"{op.kind} on axis '{g.name}' of one rank has no peer")
        if not 0 <= op.peer < g.size or op.peer == g.rank:
            raise ValueError(f"{op.kind} peer {op.peer} is not another member of {g}")
        record(op.kind, g.name, g.size, _nbytes(op.tensor))
        peer = g.global_rank_of(op.peer)
        issued.append((op, g, peer, enter_transfer(op.kind, g, peer)))
    works: Sequence[Any]
    if all(is_gloo(g) for _, g, _, _ in issued):
        # gloo does not coalesce: batch_isend_irecv would issue these same calls one by one
        works = [(dist.isend if op.kind == "send" else dist.irecv)(op.tensor, peer, g.pg) for op, g, peer, _ in issued]
    else:  # NCCL coalesces the batch into one group call
        fns = {"send": dist.isend, "recv": dist.irecv}
        works = dist.batch_isend_irecv([dist.P2POp(fns[op.kind], op.tensor, peer, g.pg) for op, g, peer, _ in issued])
    pending = [
        Pending(work, f"{op.kind} (peer {op.peer})", g, op.tensor, entered)
        for work, (op, g, _, entered) in zip(works, issued, strict=True)
    ]
    if not async_op:
        for p in pending:
            p.wait()
    return pending
