"""Tolerances for comparing one result computed two ways, derived from the dtype and the depth.

Two computations of the same value that sum in different orders (another layout, a split matrix
product, another CPU's vector kernels) differ by rounding alone, and that difference grows with
the number of dependent rounded operations between the inputs and the value: in the worst case
linearly (Higham, *Accuracy and Stability of Numerical Algorithms*, the gamma_n = n u bound).
A comparison therefore allows ``margin`` units of the dtype's epsilon per operation on the path:

    rtol = atol = margin * finfo(dtype).eps * depth

``atol`` equals ``rtol`` because intermediate values of the models here are of order one and a
compared value may be a sum that cancels (a reward of 0.01 from terms of 0.5), so its rounding
error scales with its terms, not with itself. A real bug (a missing reduction, a wrong scale, a
stale weight) moves a value by far more than this; a different rounding never does.
"""

from __future__ import annotations

import torch

#: units of epsilon allowed per dependent operation (4x the worst case of one rounding, u = eps / 2)
MARGIN = 8.0
#: dependent operations per transformer block on one pass: its matrix products, norm, softmax and
#: residual sums, counted coarsely
OPS_PER_BLOCK = 8


def tolerance(
    dtype: torch.dtype = torch.float32,
    *,
    blocks: int = 1,
    steps: int = 0,
    depth: int | None = None,
    margin: float = MARGIN,
) -> dict[str, float]:
    """``{"rtol": r, "atol": r}`` for ``torch.testing.assert_close`` of a value computed two ways.

    ``depth`` is the number of dependent rounded operations on the value's path; by default that
    of a forward through ``blocks`` blocks after ``steps`` training steps (each a forward and a
    backward): ``OPS_PER_BLOCK * blocks * (1 + 2 * steps)``.
    """
    if depth is None:
        if blocks < 1 or steps < 0:
            raise ValueError(f"tolerance: blocks must be >= 1 and steps >= 0, got blocks={blocks}, steps={steps}")
        depth = OPS_PER_BLOCK * blocks * (1 + 2 * steps)
    if depth < 1:
        raise ValueError(f"tolerance: depth must be >= 1, got {depth}")
    bound = margin * torch.finfo(dtype).eps * depth
    return {"rtol": bound, "atol": bound}


def within(got: float, expected: float, dtype: torch.dtype = torch.float32, **depth: int) -> bool:
    """Whether the scalars ``got`` and ``expected`` agree within :func:`tolerance` (same terms)."""
    tol = tolerance(dtype, **depth)
    return abs(got - expected) <= tol["atol"] + tol["rtol"] * abs(expected)
