"""tessera: train models too large or too slow for one device, with every form of parallelism
woven into one system configured from a file."""

from tessera.config import Config, load_config
from tessera.context import ParallelContext, ParallelDims, get_context
from tessera.engine import Engine, Trainer
from tessera.errors import CommError, CommTimeoutError, ConfigError, NotAvailableError, TesseraError
from tessera.launch import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch, shutdown
from tessera.session import current_config, initialize

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommTimeoutError",
    "Config",
    "Engine",
    "Trainer",
    "ConfigError",
    "NotAvailableError",
    "ParallelContext",
    "ParallelDims",
    "TesseraError",
    "__version__",
    "current_config",
    "get_context",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "shutdown",
]
