"""Which of torch's implementations an Adam or AdamW step runs: one kernel per parameter
(``for-loop``), lists of tensors at once (``foreach``), or one fused kernel (``fused``).

Chosen after ``initialize``, when the parameters (or the sharded optimizer's pieces) are real
tensors on their device: torch refuses ``fused`` for parameters still on the meta device of a
deferred model. Measured on this project's CPU machine (docs/compile.md): the fused step takes
0.30-0.34x of the for-loop step's time for the tiny and small GPTs, foreach 0.99-1.42x.
"""

from __future__ import annotations

import torch

KERNELS = ("auto", "for-loop", "foreach", "fused")


def use_step_kernel(optimizer: torch.optim.Optimizer, kernel: str) -> str:
    """Make ``optimizer``'s Adam/AdamW steps run ``kernel`` (``auto``: torch's own choice, left
    as it is). Returns the kernel now set; other optimizers take only ``auto``."""
    if kernel not in KERNELS:
        raise ValueError(f"optimizer step kernel {kernel!r} is not one of: {', '.join(KERNELS)}")
    if kernel == "auto":
        return kernel
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"a {kernel} step is torch's Adam and AdamW; {type(optimizer).__name__} takes optimizer.kernel='auto'"
        )
    for group in optimizer.param_groups:
        group["foreach"] = kernel == "foreach"
        group["fused"] = kernel == "fused"
    return kernel
