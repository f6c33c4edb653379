"""Sequence parallelism: each rank of the ``sequence`` axis holds a share of every sequence's
tokens (:class:`SequenceLayout`), and attention runs over the whole sequence in one of three
modes (:func:`sequence_attention`):

- ``"ring_qk"``: ring self-attention (RingQK and RingAV, Li et al. 2021): full score rows;
- ``"ring"``: ring attention with online softmax (Liu et al. 2023), zigzag-balanced when causal;
- ``"all_to_all"``: DeepSpeed-Ulysses' head exchange.
"""

from tessera.parallel.sequence.attention import MODES, layout_for, sequence_attention
from tessera.parallel.sequence.layout import SequenceLayout

__all__ = ["MODES", "SequenceLayout", "layout_for", "sequence_attention"]
