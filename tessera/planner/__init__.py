"""The auto-parallel planner: predicts each layout's peak memory per rank and step time from the
model's shape and the cluster's figures, searches the layouts, and explains its ranking
(docs/planner.md)."""

from tessera.planner.estimate import Estimate, MemoryEstimate, TimeEstimate, estimate
from tessera.planner.layout import Layout
from tessera.planner.spec import Cluster, Link, ModelSpec, Workload, from_gpt_preset, from_hf_config, resolve_model

__all__ = [
    "Cluster",
    "Estimate",
    "Layout",
    "Link",
    "MemoryEstimate",
    "ModelSpec",
    "TimeEstimate",
    "Workload",
    "estimate",
    "from_gpt_preset",
    "from_hf_config",
    "resolve_model",
]
