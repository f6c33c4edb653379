"""tessera: train models too large or too slow for one device, with every form of parallelism
woven into one system configured from a file.

The public names load on first use (PEP 562), so ``tessera --help`` and ``--version`` answer
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Config": "tessera.config",
    "load_config": "tessera.config",
    "ParallelContext": "tessera.context",
    "ParallelDims": "tessera.context",
    "get_context": "tessera.context",
    "Engine": "tessera.engine",
    "Trainer": "tessera.engine",
    "BudgetError": "tessera.errors",
    "CommError": "tessera.errors",
    "CommTimeoutError": "tessera.errors",
    "ConfigError": "tessera.errors",
    "NotAvailableError": "tessera.errors",
    "OffloadError": "tessera.errors",
    "TesseraError": "tessera.errors",
    "launch": "tessera.launcher",
    "launch_from_openmpi": "tessera.launcher",
    "launch_from_slurm": "tessera.launcher",
    "launch_from_torch": "tessera.launcher",
    "shutdown": "tessera.launcher",
    "current_config": "tessera.session",
    "checkpoint_blocks": "tessera.nn.recompute",
    "deferred_init": "tessera.init",
    "initialize": "tessera.session",
}

if TYPE_CHECKING:
    from tessera.config import Config, load_config
    from tessera.context import ParallelContext, ParallelDims, get_context
    from tessera.engine import Engine, Trainer
    from tessera.errors import (
        BudgetError,
        CommError,
        CommTimeoutError,
        ConfigError,
        NotAvailableError,
        OffloadError,
        TesseraError,
    )
    from tessera.init import deferred_init
    from tessera.launcher import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch, shutdown
    from tessera.nn.recompute import checkpoint_blocks
    from tessera.session import current_config, initialize


# subpackages reachable as attributes without an import of their own (``tessera.lora.apply``)
_SUBPACKAGES = ("lora",)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tessera.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "BudgetError",
    "CommError",
    "CommTimeoutError",
    "Config",
    "Engine",
    "Trainer",
    "ConfigError",
    "NotAvailableError",
    "OffloadError",
    "ParallelContext",
    "ParallelDims",
    "TesseraError",
    "__version__",
    "checkpoint_blocks",
    "current_config",
    "deferred_init",
    "get_context",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "shutdown",
]
