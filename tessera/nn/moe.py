"""Mixture of experts: a router sends each token to ``top_k`` of ``num_experts`` MLPs and sums
their outputs weighted by its routing probabilities.

Routing: the router's logits (fp32) give each token a softmax over the experts; it takes the
``top_k`` largest, and with ``top_k > 1`` renormalises their weights to sum to one (Mixtral;
``normalize=False`` keeps the raw probabilities, Switch's top-1 does). Capacity: each expert
takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments; the first
choices of all tokens are served before any second choice, and within a choice earlier tokens
first, so an expert over capacity drops the later tokens' assignments (a dropped assignment adds
nothing; a token whose every choice is dropped comes out as zeros, the residual around the
layer carrying it). ``capacity_factor=None``: no token is dropped.

Experts compute grouped: the kept assignments are packed into one ``[experts, slots, d_model]``
buffer (slots: the capacity, or the fullest expert's count without one) and every expert's MLP
runs as a batched matrix product over it, with no Python loop over experts or tokens. Experts
are GELU MLPs or SwiGLU ones (LLaMA/Mixtral).

Expert parallelism (the context's ``expert`` axis, a split of the data axis: each of its ranks
holds ``num_experts / size`` experts, consecutive): every rank routes its own tokens and packs
its ``[experts, slots, d_model]`` buffer as above; an all-to-all through :mod:`tessera.comm`
sends each expert's slots to the rank holding it (``[local experts, size x slots, d_model]``
there), the local experts compute, and the inverse all-to-all brings the outputs back (the
backward runs both in reverse). Capacity counts each rank's own tokens, as if the single-process
layer ran on each rank's batch (a data-parallel rank's micro-batch is a micro-batch: routing, drops
and auxiliary losses are per micro-batch, as under gradient accumulation in one process); without
a capacity, the slots are the fullest expert's count over the group (a max all-reduce). The router
is replicated; the gradients of the local experts come from every rank's tokens, and the training
strategies average them over the ranks holding the same experts (``ctx.expert_replicas``). With
1D tensor parallelism each expert's hidden width is split over the tensor axis (column-parallel
``w_in``/``w_gate``, row-parallel ``w_out``): every tensor rank exchanges the same tokens and the
outputs are summed over the tensor axis. Expert weights carry their placement (``expert`` on the
expert dimension, ``tensor`` on the hidden one), so norms, checkpoints and resharding see them as
blocks of the single-process ``[num_experts, ...]`` tensors.

Auxiliary losses of the last forward (``MoE.aux_loss``; :func:`auxiliary_loss` sums them over a
model): the load-balancing loss ``num_experts * sum_e f_e * P_e`` (``f_e``: the fraction of the
assignments routed to expert e before capacity, ``P_e``: its mean routing probability; 1 when
balanced) times ``aux_loss_weight``, and the router z-loss ``mean(logsumexp(logits)^2)`` times
``z_loss_weight``. They join the backward pass through the layer's output, with the weight
``aux_grad_scale`` (1: as if added to the loss the backward starts from): there is nothing to add
to the loss, and a pipeline stage's layers get their share without the last stage knowing them.
The engine sets the weight to what it scales each micro-batch's loss by (``1 / micro-batches``,
times the fp16 loss scale: :func:`set_aux_grad_scale`). ``MoE.stats`` holds the last forward's
tokens per expert (kept) and drops; :func:`take_routing_counts` the counts summed over the
forwards since it was last called (for logging; a recompute in the backward does not count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.placement import ShardSpec, placement_of
from tessera.graph_breaks import eager_in_compiled_code
from tessera.nn.layers import resolve_context
from tessera.parallel.tensor.common import local_shard, shard_parameter

Activation = Literal["gelu", "swiglu"]
#: ``adapter(projection name, its input) -> a term added to its output`` (:meth:`GroupedExperts.forward`)
ExpertAdapter = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RoutingStats:
    """One forward's routing: ``tokens_per_expert`` (assignments each expert computed, after
    capacity), ``dropped`` (assignments over capacity), ``capacity`` (slots per expert; None:
    unbounded), ``load_balance`` and ``z_loss`` (the unweighted auxiliary losses)."""

    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor  # a 0-dim count: a Python int would make compiled code recompile for each value
    capacity: int | None
    load_balance: torch.Tensor
    z_loss: torch.Tensor


def expert_groups(ctx: ParallelContext | None) -> tuple[AxisGroup | None, AxisGroup | None]:
    """The expert group and the tensor group an MoE layer splits over in ``ctx`` (None: not split);
    refuses layouts whose activations an MoE cannot route (2D/2.5D/3D tensor modes, 1D with
    sequence-parallel regions)."""
    if ctx is None:
        return None, None
    experts = ctx.group("expert") if ctx.size("expert") > 1 else None
    tensor = ctx.group("tensor") if ctx.size("tensor") > 1 else None
    if tensor is not None and (ctx.dims.tensor_mode != "1d" or ctx.dims.sequence_parallel):
        raise ValueError(
            f"MoE: tensor parallelism inside experts is 1D without sequence-parallel regions; this layout has mode "
            f"{ctx.dims.tensor_mode!r}" + (" with sequence_parallel" if ctx.dims.sequence_parallel else "")
        )
    return experts, tensor


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs ``d_model -> ff_dim -> d_model`` held as stacked weights and run as
    batched products over a ``[experts, slots, d_model]`` buffer. In a context with an expert
    axis this rank holds ``num_experts / size`` of them, and with 1D tensor parallelism its
    block of each one's hidden width."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        ff_dim: int,
        activation: Activation = "gelu",
        *,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"expert activation {activation!r} is not one of gelu, swiglu")
        ctx = resolve_context(ctx)
        experts, tensor = expert_groups(ctx)
        if experts is not None and num_experts % experts.size:
            raise ValueError(f"MoE: num_experts={num_experts} does not split over {experts.size} expert-parallel ranks")
        if tensor is not None and ff_dim % tensor.size:
            raise ValueError(f"MoE: the experts' ff_dim={ff_dim} does not split over {tensor.size} tensor ranks")
        self.activation = activation
        self.tensor = tensor
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, ff_dim))
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, ff_dim)) if activation == "swiglu" else None
        self.w_out = nn.Parameter(torch.empty(num_experts, ff_dim, d_model))
        self.reset_parameters()  # drawn in full: the same values in every layout
        if experts is not None or tensor is not None:
            assert ctx is not None
            e_axis = ("expert",) if experts is not None else ()
            t_axis = ("tensor",) if tensor is not None else ()
            column = ShardSpec((num_experts, d_model, ff_dim), (e_axis, (), t_axis))
            self.w_in = shard_parameter(self.w_in, column, ctx)
            if self.w_gate is not None:
                self.w_gate = shard_parameter(self.w_gate, column, ctx)
            self.w_out = shard_parameter(
                self.w_out, ShardSpec((num_experts, ff_dim, d_model), (e_axis, t_axis, ())), ctx
            )

    def weights(self) -> list[nn.Parameter]:
        return [w for w in (self.w_in, self.w_gate, self.w_out) if w is not None]

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weight: uniform in +-1/sqrt(fan_in), drawn
        for the whole ``[num_experts, ...]`` tensor and this rank's block kept."""
        with torch.no_grad():
            for weight in self.weights():
                placement = placement_of(weight)
                shape = placement.full_shape(weight)
                bound = 1.0 / math.sqrt(shape[1])
                full = torch.empty(shape, dtype=weight.dtype, device=weight.device).uniform_(-bound, bound)
                if placement.shard is not None:
                    assert placement.mesh is not None
                    full = local_shard(full, placement.shard, placement.mesh)
                weight.copy_(full)

    def forward(self, x: torch.Tensor, adapter: ExpertAdapter | None = None) -> torch.Tensor:
        """``[local experts, slots, d_model]`` -> the same. ``adapter(name, x)``: a further product
        of projection ``name``'s input (``"w_in"``, ``"w_gate"``, ``"w_out"``), in its output's
        local shape, added to the projection (before the tensor sum for ``w_out``: a LoRA
        adapter's, ``tessera.lora.experts``)."""
        if self.tensor is not None:  # every tensor rank has the tokens; each computes its block of the width
            x = comm.copy_forward_all_reduce_backward(x, self.tensor)
        hidden = self._project("w_in", x, adapter)
        if self.w_gate is not None:
            hidden = F.silu(self._project("w_gate", x, adapter)) * hidden
        else:
            hidden = F.gelu(hidden)
        out = self._project("w_out", hidden, adapter)
        if self.tensor is not None:
            out = comm.all_reduce_forward_copy_backward(out, self.tensor)
        return out

    def _project(self, name: str, x: torch.Tensor, adapter: ExpertAdapter | None) -> torch.Tensor:
        y = torch.bmm(x, getattr(self, name))
        return y if adapter is None else y + adapter(name, x)


class _AttachAuxiliary(torch.autograd.Function):
    """``y`` unchanged; in the backward, the auxiliary loss gets the gradient ``aux_grad_scale``
    of the layer that made it (read then: the engine may set it after the forward)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, owner: MoE) -> torch.Tensor:  # type: ignore[override]
        ctx.owner = owner
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        scale = torch.tensor(float(ctx.owner.aux_grad_scale), dtype=torch.float32, device=grad.device)
        return grad, scale, None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (a block's forward
    recomputed by activation checkpointing runs inside it)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``[..., d_model] -> [..., d_model]`` (see the module docstring).
    ``ctx``: the context whose ``expert`` (and 1D ``tensor``) axes split the experts; default:
    the current one (none: one process)."""

    def __init__(
        self,
        d_model: int,
        ff_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        activation: Activation = "swiglu",
        normalize: bool | None = None,
        aux_loss_weight: float = 1e-2,
        z_loss_weight: float = 1e-3,
        *,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be positive (None: no drops)")
        ctx = resolve_context(ctx)
        self.group, _ = expert_groups(ctx)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.normalize = top_k > 1 if normalize is None else normalize
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, d_model, ff_dim, activation, ctx=ctx)
        self.aux_loss: torch.Tensor | None = None
        self.aux_grad_scale = 1.0
        self.stats: RoutingStats | None = None
        self._counts: torch.Tensor | None = None  # kept assignments per expert since take_routing_counts
        self._dropped: torch.Tensor | int = 0

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for ``tokens`` tokens (None: unbounded)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [T, E] fp32, probabilities [T, E], weights [T, k], experts [T, k])`` of the
        tokens ``x`` [T, d]."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        count, e, k = tokens.shape[0], self.num_experts, self.top_k
        logits, probs, weights, experts = self.route(tokens)
        capacity = self.capacity(count)
        y, routed, per_expert, dropped = dispatch(tokens, weights, experts, e, capacity, self.experts, self.group)
        load_balance = e * (routed.float() / (count * k) * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        aux = self.aux_loss_weight * load_balance + self.z_loss_weight * z_loss
        self.aux_loss = aux
        self.stats = RoutingStats(per_expert, dropped, capacity, load_balance.detach(), z_loss.detach())
        if not _in_backward():
            self._counts = per_expert if self._counts is None else self._counts + per_expert
            self._dropped += dropped
        y = y.view(shape)
        if torch.is_grad_enabled() and aux.requires_grad:
            y = _attach_auxiliary(y, aux, self)
        return y


@eager_in_compiled_code
def _attach_auxiliary(y: torch.Tensor, aux: torch.Tensor, owner: MoE) -> torch.Tensor:
    # Eager even inside a compiled block (a deliberate graph break, docs/compile.md): the backward
    # reads the owner's aux_grad_scale when it runs, which the engine sets after the forward; a
    # compiled backward would keep the value seen while tracing.
    return _AttachAuxiliary.apply(y, aux, owner)  # type: ignore[no-any-return]


def dispatch(
    tokens: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    compute: Callable[[torch.Tensor], torch.Tensor],
    group: AxisGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send each token ``tokens`` [T, d] to its chosen ``experts`` [T, k] and sum their outputs
    weighted by ``weights`` [T, k]: the assignments are served first choices first, earlier tokens
    first, ``capacity`` per expert (None: all), packed into one ``[experts, slots, d]`` buffer that
    ``compute`` (the local experts: ``[local experts, slots', d] -> same``) runs on, here or, with
    ``group``, on the rank holding each expert (all-to-all there and back).

    Returns ``(y [T, d], routed [experts] before capacity, kept [experts] after it, dropped)``,
    ``dropped`` a 0-dim tensor (an int would make compiled code recompile for each count).
    The one routing path behind :class:`MoE` and the Hugging Face MoE blocks tessera runs."""
    count, d, k = tokens.shape[0], tokens.shape[-1], experts.shape[-1]
    # assignments in serving order: every token's first choice, then every second choice
    chosen = experts.t().reshape(-1)
    token = torch.arange(count, device=tokens.device).repeat(k)
    weight = weights.t().reshape(-1)
    one_hot = F.one_hot(chosen, num_experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
    routed = one_hot.sum(dim=0)
    slots = capacity if capacity is not None else _fullest(routed, group)
    kept = position < slots
    slot = (chosen * slots + position)[kept]
    buffer = tokens.new_zeros(num_experts * slots, d).index_copy(0, slot, tokens[token[kept]])
    out = _exchange(buffer.view(num_experts, slots, d), compute, group).reshape(num_experts * slots, d)
    combined = out[slot] * weight[kept].unsqueeze(-1).to(out.dtype)
    y = tokens.new_zeros(count, d).index_add(0, token[kept], combined.to(tokens.dtype))
    per_expert = F.one_hot(chosen[kept], num_experts).sum(dim=0).detach()
    return y, routed, per_expert, (~kept).sum().detach()


def _fullest(routed: torch.Tensor, group: AxisGroup | None) -> int:
    """The most assignments any expert got here, or on any rank of the expert group."""
    most = routed.max().reshape(1)
    if group is not None and group.size > 1:
        most = comm.all_reduce(most.clone(), group, op="max")
    return max(1, int(most))


def _exchange(
    buffer: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor], group: AxisGroup | None
) -> torch.Tensor:
    """The experts' outputs for ``buffer`` [experts, slots, d]: here, or on the ranks that hold
    them (all-to-all there and back)."""
    if group is None or group.size == 1:
        return compute(buffer)
    here = comm.all_to_all_forward_all_to_all_backward(buffer, group, 0, 1)  # [local, size*slots, d]
    return comm.all_to_all_forward_all_to_all_backward(compute(here), group, 1, 0)


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the auxiliary losses of ``model``'s MoE layers from their last forward (None:
    no MoE layer ran), for reporting: the backward pass already includes them (module docstring)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """``model``'s MoE layers with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module | Iterable[MoE], scale: float) -> None:
    """Give every MoE layer of ``model`` the weight its auxiliary losses enter the backward with
    (the factor each micro-batch's loss is multiplied by before its backward)."""
    layers = [m for _, m in moe_layers(model)] if isinstance(model, nn.Module) else list(model)
    for layer in layers:
        layer.aux_grad_scale = scale


def take_routing_counts(model: nn.Module | list[tuple[str, MoE]]) -> dict[str, tuple[torch.Tensor, int]]:
    """Per MoE layer of ``model`` (by name; or the ``(name, layer)`` pairs of :func:`moe_layers`):
    the assignments each expert computed and the assignments dropped, summed over this rank's
    forwards since the last call (recomputes in the backward excluded); the counts start again
    from zero."""
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for name, layer in moe_layers(model) if isinstance(model, nn.Module) else model:
        counts = layer._counts if layer._counts is not None else torch.zeros(layer.num_experts, dtype=torch.long)
        out[name] = (counts, int(layer._dropped))
        layer._counts, layer._dropped = None, 0
    return out


__all__ = [
    "ExpertAdapter",
    "GroupedExperts",
    "MoE",
    "RoutingStats",
    "auxiliary_loss",
    "dispatch",
    "expert_groups",
    "moe_layers",
    "set_aux_grad_scale",
    "take_routing_counts",
]
