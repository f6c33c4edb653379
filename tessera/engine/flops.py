"""Model FLOPs per token and model FLOP utilisation (MFU).

FLOPs per token are the floating-point operations one token costs in a training step, forward
and backward, counted as *model* FLOPs: what the model needs, not what the hardware ran (no
recomputation under activation checkpointing, no padded expert slots, no dequantization). A
model that knows its shape says so (:class:`ReportsFlops`: tessera's GPT), by the transformer
formula (:func:`transformer_flops_per_token`); any other model is counted with torch's
``FlopCounterMode`` over one forward and backward of an example batch
(:func:`counted_flops_per_token`). :func:`flops_per_token` chooses.

MFU (:func:`mfu`) is what one rank achieves over what one rank's device can do: the global
batch's tokens per second times the FLOPs per token, shared out over the world's ranks, over the
peak of one rank's device (:mod:`tessera.engine.peak`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tessera.context.placement import full_numel
from tessera.lora.quant import QuantizedLinear
from tessera.nn.moe import MoE

_aten = torch.ops.aten


def transformer_flops_per_token(
    n_params: int, n_layers: int, d_model: int, seq_len: int, *, frozen_params: int = 0
) -> int:
    """Training FLOPs per token of a decoder: ``6 N + 4 F + 12 L d s``.

    ``n_params`` (N): the trained parameters that act on each token, each costing 2 FLOPs in the
    forward product and 4 in the backward (the gradients of its input and of itself); lookup
    tables (position embeddings, a token embedding not tied to the output head) do no product
    and are left out by the caller, a tied embedding counts once (the head's product); an MoE
    layer's experts count ``top_k / num_experts`` of theirs. Norm gains and biases are in N
    though they do elementwise work (6 FLOPs per element overstates it a little).
    ``frozen_params`` (F): parameters that take part in products but are not trained (a LoRA
    base): 2 in the forward, 2 for their input's gradient. ``12 L d s``: the attention's two
    products per layer (scores ``Q K^T`` and weighted values ``P V``, ``2 s d`` FLOPs each per
    token forward, twice that backward), over the **full** ``s x s`` score matrix, not the
    causal half that a masked kernel needs: the PaLM paper's count (Chowdhery et al. 2022,
    appendix B: ``6N + 12LHQT``) and Megatron's, and what ``FlopCounterMode`` counts for
    ``scaled_dot_product_attention``. Softmax, norms, activations and the loss are left out.
    """
    return 6 * n_params + 4 * frozen_params + 12 * n_layers * d_model * seq_len


@dataclass(frozen=True)
class MatmulParameters:
    """Elements of the parameters that act on each token through a product, MoE experts at
    ``top_k / num_experts``: ``trained`` (they get a gradient), ``frozen`` (they do not)."""

    trained: int
    frozen: int


def matmul_parameters(model: nn.Module, lookups: Iterable[torch.Tensor] = ()) -> MatmulParameters:
    """The parameters of ``model`` that act on each token, in full (single-process) sizes, each
    shared tensor once: every parameter except the ``lookups`` (tables read by index, such as a
    position embedding), the experts of each :class:`~tessera.nn.MoE` at ``top_k / num_experts``
    of their size (a token meets ``top_k`` of them), and the frozen weight a
    :class:`~tessera.lora.quant.QuantizedLinear` keeps as codes. Works on a deferred (meta) or
    tensor-parallel model alike: sizes come from each parameter's placement."""
    skip = {id(t) for t in lookups}
    share: dict[int, tuple[int, int]] = {}  # parameter id -> (top_k, num_experts) for MoE experts
    frozen_codes = 0
    for module in model.modules():
        if isinstance(module, MoE):
            for weight in module.experts.parameters():
                share[id(weight)] = (module.top_k, module.num_experts)
        elif isinstance(module, QuantizedLinear):
            frozen_codes += module.in_features * module.out_features
    trained = frozen = 0
    for param in model.parameters():  # each shared (tied) tensor once
        if id(param) in skip:
            continue
        top_k, experts = share.get(id(param), (1, 1))
        count = full_numel(param) * top_k // experts
        if param.requires_grad:
            trained += count
        else:
            frozen += count
    return MatmulParameters(trained, frozen + frozen_codes)


@runtime_checkable
class ReportsFlops(Protocol):
    """A model that knows its training FLOPs per token (tessera's GPT does)."""

    def flops_per_token(self, seq_len: int) -> int:
        """Forward and backward FLOPs per token at sequences of ``seq_len`` tokens."""
        ...


def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    from torch.utils import flop_counter

    return int(flop_counter.sdpa_flop_count(query, key, value))


def _sdpa_cpu_backward(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    from torch.utils import flop_counter

    return int(flop_counter.sdpa_backward_flop_count(grad, query, key, value))


# torch counts the CUDA attention kernels but not the CPU one: the same formulas (forward: two
# products over the full score matrix; backward: five, the scores recomputed as the kernels do)
_CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def _tokens_in(inputs: Sequence[Any]) -> int:
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError("counted_flops_per_token: the example has no batch tensor to count tokens in; pass tokens=")
    if first.dtype.is_floating_point or first.dtype.is_complex:
        return first.numel() // first.shape[-1]  # [..., features]: one token per feature vector
    return first.numel()  # token ids


def counted_flops_per_token(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    tokens: int | None = None,
) -> float:
    """FLOPs per token that ``torch.utils.flop_counter.FlopCounterMode`` counts over one forward
    of ``model(*example_inputs)`` and the backward of ``loss_fn(outputs)`` (default: the sum of
    the outputs), divided by ``tokens`` (default: the elements of the first input when it holds
    token ids, its vectors ``numel / shape[-1]`` when it is floating point).

    Counted are the products (matmuls, convolutions, attention; the CPU attention kernel with
    the formulas torch gives the CUDA ones, which count the backward's recomputed scores); the
    elementwise work (norms, softmax, activations, the loss) is not. The backward goes to the
    trained parameters through ``torch.autograd.grad``, so no ``.grad`` is touched, and the
    random number generators are restored after (dropout draws nothing that training would see).
    """
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    count = tokens if tokens is not None else _tokens_in(inputs)
    trained = [p for p in model.parameters() if p.requires_grad]
    devices = sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda})
    with (
        torch.random.fork_rng(devices=devices),
        FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter,
    ):
        outputs = model(*inputs)
        loss = loss_fn(outputs) if loss_fn is not None else outputs.float().sum()
        if trained and loss.requires_grad:
            torch.autograd.grad(loss, trained, allow_unused=True)
    return counter.get_total_flops() / count


def flops_per_token(
    model: nn.Module,
    seq_len: int,
    *,
    example_inputs: torch.Tensor | Sequence[Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> float:
    """Training FLOPs per token of ``model`` at sequences of ``seq_len`` tokens: its own count
    when it has one (:class:`ReportsFlops`, such as tessera's GPT: the transformer formula),
    else counted over one forward and backward of ``example_inputs`` (a batch as the model takes
    it, of ``seq_len``-token sequences) with ``loss_fn`` (:func:`counted_flops_per_token`).
    Raises ValueError for a model without a count of its own and no example to count."""
    if isinstance(model, ReportsFlops):
        return float(model.flops_per_token(seq_len))
    if example_inputs is None:
        raise ValueError(
            f"flops_per_token: {type(model).__name__} does not report its FLOPs per token "
            "(no flops_per_token(seq_len) method); pass example_inputs= (and loss_fn=) to count them"
        )
    return counted_flops_per_token(model, example_inputs, loss_fn)


def achieved_flops_per_rank(tokens_per_s: float, flops_per_token: float, world_size: int) -> float:
    """Model FLOP/s one rank achieves: the global batch's ``tokens_per_s`` (every data-parallel
    replica's tokens) times ``flops_per_token``, shared out over the ``world_size`` ranks that
    did the work (tensor, pipeline and sequence ranks split a replica's work among them)."""
    return tokens_per_s * flops_per_token / world_size


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation, 0-1: :func:`achieved_flops_per_rank` over the peak FLOP/s of one
    rank's device (``peak_flops_per_s``)."""
    return achieved_flops_per_rank(tokens_per_s, flops_per_token, world_size) / peak_flops_per_s


__all__ = [
    "MatmulParameters",
    "ReportsFlops",
    "achieved_flops_per_rank",
    "counted_flops_per_token",
    "flops_per_token",
    "matmul_parameters",
    "mfu",
    "transformer_flops_per_token",
]
