"""One entry point for the three sequence-parallel attention modes."""

from __future__ import annotations

import torch

from tessera.comm import Group, resolve
from tessera.parallel.sequence.blocks import keep_mask
from tessera.parallel.sequence.layout import SequenceLayout
from tessera.parallel.sequence.ring import ring_attention
from tessera.parallel.sequence.ring_qk import ring_self_attention
from tessera.parallel.sequence.ulysses import masked_attention, ulysses_attention

MODES = {"ring_qk": ring_self_attention, "ring": ring_attention, "all_to_all": ulysses_attention}


def layout_for(mode: str, length: int, size: int) -> SequenceLayout:
    """The layout each mode splits sequences in: zigzag for ring attention (a causal mask then
    gives every rank the same work), contiguous for the others. Sequence lengths that do not
    divide into its pieces are padded (see :class:`SequenceLayout`)."""
    if mode not in MODES:
        raise ValueError(f"sequence parallelism mode {mode!r} is not one of {sorted(MODES)}")
    return SequenceLayout(length, size, zigzag=mode == "ring" and size > 1)


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    layout: SequenceLayout,
    mode: str = "ring",
    causal: bool = False,
    key_keep: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence for this rank's tokens: ``q``, ``k``, ``v``
    [b, h, layout.local, d] are this rank's tokens of ``layout`` (the ``group``'s members hold
    the rest); ``key_keep`` [b, layout.local], True for a real key, is this rank's part of a
    key-padding mask. Returns [b, h, layout.local, d]; query rows with no key give zeros."""
    if mode not in MODES:
        raise ValueError(f"sequence parallelism mode {mode!r} is not one of {sorted(MODES)}")
    g = resolve(group)
    if g.size != layout.size:
        raise ValueError(f"the layout splits the sequence over {layout.size} ranks but the group has {g.size}")
    if q.shape[2] != layout.local or k.shape[2] != layout.local or v.shape[2] != layout.local:
        raise ValueError(
            f"q, k and v must hold this rank's {layout.local} tokens along dim 2; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if g.size == 1:
        pos = layout.positions(0, q.device)
        plain = layout.padded == layout.length and key_keep is None
        keep = None if plain else keep_mask(pos, pos, layout.length, causal, key_keep)
        return masked_attention(q, k, v, keep, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    return MODES[mode](q, k, v, g, layout, causal, key_keep, scale)  # type: ignore[no-any-return]


__all__ = ["MODES", "layout_for", "sequence_attention"]
