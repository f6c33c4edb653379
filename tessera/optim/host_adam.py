"""``HostAdamW``: AdamW for tensors in host (CPU) memory, used when ZeRO offloads the optimizer.

Two things make it fast:

1. the kernel: PyTorch's own fused CPU AdamW (``fused=True``; part of PyTorch, no extension)
   where this torch has it, else the multi-tensor ``foreach`` path;
2. flat buffers: the per-tensor cost of any kernel dominates when the optimizer holds thousands
   of small 1-D pieces (ZeRO shards), so each parameter group keeps its parameters, gradients and
   states per dtype in one flat buffer and steps it with ONE kernel call. Parameters that already
   tile one buffer in order (a ZeRO shard's pieces) are used in place; otherwise they are copied
   into a new flat buffer and re-pointed at their part of it (``p.data`` is set: the same tensor
   objects, new storage; views of them taken before do not follow). ``coalesce=False`` keeps
   every tensor where it is and steps the list.

Same arithmetic as ``torch.optim.AdamW``: the result equals ``AdamW(foreach=False)`` to float
rounding, and ``state_dict()`` has AdamW's layout (per-parameter ``step``, ``exp_avg``,
``exp_avg_sq``; its tensors are views into the flat buffers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.adamw import adamw as adamw_functional

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@functools.cache
def fused_cpu_adamw_available() -> bool:
    """Whether this torch has a fused AdamW kernel for CPU tensors (tried once on a tiny tensor)."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


@dataclass
class _Bucket:
    """Parameters of one group and dtype stepped as one flat tensor; ``views[key][i]`` is the part
    of ``flat[key]`` that belongs to ``params[i]`` (key: param, grad, exp_avg, ...)."""

    params: list[torch.Tensor]
    flat: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [len(params)] fp32


def _tiled_region(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor over the storage that ``params`` tile back to back in order, if they do."""
    nonempty = [p for p in params if p.numel() > 0]
    if not nonempty or not all(p.is_contiguous() for p in nonempty):
        return None
    storage = nonempty[0].untyped_storage()
    start = offset = nonempty[0].storage_offset()
    for p in nonempty:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset:
            return None
        offset += p.numel()
    return torch.empty(0, dtype=nonempty[0].dtype).set_(storage, start, (offset - start,), (1,))


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` with the shapes of ``like``, back to back."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


class HostAdamW(torch.optim.AdamW):
    """AdamW over CPU tensors with flat buffers and the fused CPU kernel (see the module docstring).

    Takes AdamW's arguments; ``fused``/``foreach`` left None pick fused where available.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        coalesce: bool = True,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        decoupled_weight_decay: bool = True,
    ) -> None:
        if capturable or differentiable or not decoupled_weight_decay:
            raise ValueError("HostAdamW is AdamW on the host: capturable, differentiable and coupled decay are not")
        if fused is None and foreach is None:
            fused = fused_cpu_adamw_available()
            foreach = not fused
        self._coalesce = coalesce
        self._buckets: list[list[_Bucket]] = []  # per param group
        self._user: torch.optim.Optimizer | None = None  # whose group dicts these are (taking_over)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach, fused=fused)

    # ---- buffers ------------------------------------------------------------------------------
    @classmethod
    def taking_over(cls, user: torch.optim.AdamW) -> HostAdamW:
        """A ``HostAdamW`` over ``user``'s parameter groups (their settings, and the group dicts
        themselves, so that schedulers bound to ``user`` that change an ``lr`` still reach it)."""
        keys = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        host = cls([{k: g[k] for k in keys if k in g} for g in user.param_groups])
        for host_group, user_group in zip(host.param_groups, user.param_groups):
            user_group.update(fused=host_group["fused"], foreach=host_group["foreach"], params=host_group["params"])
        host.param_groups = user.param_groups
        host._user = user
        return host

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.device.type != "cpu":
                raise ValueError(f"HostAdamW holds host tensors; got one on {p.device}")
            if p.is_sparse:
                raise ValueError("HostAdamW does not take sparse tensors")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in group["params"]:
            by_dtype.setdefault(p.dtype, []).append(p)
        if self._coalesce:
            buckets = [self._make_bucket(ps, group["amsgrad"]) for ps in by_dtype.values()]
        else:
            buckets = [self._make_bucket([p], group["amsgrad"]) for p in group["params"]]
        self._buckets.append(buckets)

    @torch.no_grad()
    def _make_bucket(self, params: list[torch.Tensor], amsgrad: bool) -> _Bucket:
        bucket = _Bucket(params)
        region = _tiled_region(params)
        if region is None:  # move the parameters into one new flat buffer
            # pinned when the tensors were (ZeRO offload's masters, copied to a GPU every step)
            region = torch.empty(
                sum(p.numel() for p in params), dtype=params[0].dtype, pin_memory=any(p.is_pinned() for p in params)
            )
            for p, view in zip(params, _split(region, params)):
                view.copy_(p)
                p.data = view
        bucket.flat["param"] = region
        keys = ("grad", *(_STATE_KEYS if amsgrad else _STATE_KEYS[:2]))
        for key in keys:
            bucket.flat[key] = torch.zeros_like(region)
            bucket.views[key] = _split(bucket.flat[key], params)
        bucket.steps = torch.zeros(len(params), dtype=torch.float32)
        self._point_state_at(bucket)
        return bucket

    def _point_state_at(self, bucket: _Bucket) -> None:
        """Make ``self.state[p]`` hold the views of ``bucket``'s flat state (AdamW's layout)."""
        for i, p in enumerate(bucket.params):
            state = {key: bucket.views[key][i] for key in _STATE_KEYS if key in bucket.views}
            state["step"] = bucket.steps[i]
            self.state[p] = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an AdamW state dict (this class's or ``torch.optim.AdamW``'s) into the flat buffers."""
        super().load_state_dict(state_dict)
        if self._user is not None:  # loading made new group dicts: share the user's again (schedulers)
            for user_group, group in zip(self._user.param_groups, self.param_groups):
                user_group.update(group)
            self.param_groups = self._user.param_groups
        for group in self.param_groups:  # this optimizer's kernel, whatever the saved one used
            group["fused"], group["foreach"] = self.defaults["fused"], self.defaults["foreach"]
        with torch.no_grad():
            for buckets in self._buckets:
                for bucket in buckets:
                    for i, p in enumerate(bucket.params):
                        loaded = self.state.get(p, {})
                        for key in _STATE_KEYS:
                            if key in bucket.views:
                                view = bucket.views[key][i]
                                if key in loaded:
                                    view.copy_(loaded[key])
                                else:
                                    view.zero_()
                        bucket.steps[i] = float(loaded.get("step", 0.0))
                    self._point_state_at(bucket)

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, buckets in zip(self.param_groups, self._buckets):
            for bucket in buckets:
                self._step_bucket(group, bucket)
        return loss

    def _step_bucket(self, group: dict[str, Any], bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        if all(g is not None for g in grads) and bool((bucket.steps == bucket.steps[0]).all()):
            # The common case: one kernel call over the flat buffers.
            views = bucket.views["grad"]
            stale = [i for i, g in enumerate(grads) if g is not views[i]]
            if stale:
                flat_grad = bucket.flat["grad"]
                if len(stale) == len(grads) and all(g.dim() == 1 and g.dtype == flat_grad.dtype for g in grads):  # type: ignore[union-attr]
                    torch.cat(grads, out=flat_grad)  # type: ignore[arg-type]  # 1-D pieces: one copy kernel
                else:
                    torch._foreach_copy_([views[i] for i in stale], [grads[i] for i in stale])  # type: ignore[misc]
                for i in stale:
                    bucket.params[i].grad = views[i]  # later backwards accumulate into the flat buffer
            step = bucket.steps[0:1].view(())
            self._adam(group, bucket.flat, [step], single=True)
            bucket.steps[1:] += 1
            return
        # Some tensors have no gradient this step: AdamW leaves them alone, so step the others one
        # by one (their step counts differ from now on).
        index = [i for i, g in enumerate(grads) if g is not None]
        if index:
            per_param = {key: [bucket.views[key][i] for i in index] for key in bucket.views}
            per_param["param"] = [bucket.params[i] for i in index]
            per_param["grad"] = [grads[i] for i in index]  # type: ignore[misc]
            self._adam(group, per_param, [bucket.steps[i] for i in index], single=False)

    def _adam(
        self,
        group: dict[str, Any],
        tensors: dict[str, Any],
        steps: list[torch.Tensor],
        single: bool,
    ) -> None:
        """torch's AdamW arithmetic over ``tensors`` (flat tensors when ``single``, else lists)."""

        def listed(key: str) -> list[torch.Tensor]:
            value = tensors.get(key)
            if value is None:
                return []
            return [value] if single else list(value)

        beta1, beta2 = group["betas"]
        adamw_functional(
            listed("param"),
            listed("grad"),
            listed("exp_avg"),
            listed("exp_avg_sq"),
            listed("max_exp_avg_sq"),
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            capturable=False,
            differentiable=False,
            grad_scale=None,
            found_inf=None,
            has_complex=False,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )
