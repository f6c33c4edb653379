"""Layer 4: ``initialize``, ``Engine``, ``Trainer`` and its hooks."""

from tessera.engine.compiled import CompileReportHook
from tessera.engine.engine import Engine
from tessera.engine.hooks import (
    CheckpointHook,
    EvalHook,
    Hook,
    LogHook,
    LRSchedulerHook,
    MemoryHook,
    ProgressBarHook,
    RoutingHook,
    ThroughputHook,
)
from tessera.engine.initialize import initialize
from tessera.engine.trainer import Trainer
from tessera.engine.utilisation import UtilisationHook

__all__ = [
    "CheckpointHook",
    "CompileReportHook",
    "Engine",
    "EvalHook",
    "Hook",
    "LRSchedulerHook",
    "LogHook",
    "MemoryHook",
    "ProgressBarHook",
    "RoutingHook",
    "ThroughputHook",
    "Trainer",
    "UtilisationHook",
    "initialize",
]
