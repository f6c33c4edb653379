"""The link a group's communication runs over: a mesh axis's span of consecutive ranks (within
a node or across), and calibration's measured links by axis or by op and group size."""

from __future__ import annotations

import math

from tessera.planner.layout import Layout
from tessera.planner.spec import Cluster, Link
from tessera.planner.timing.counting import P2P


def axis_span(layout: Layout, axis: str) -> int:
    """Consecutive ranks one group of ``axis`` spans (the axis and every axis inside it, tensor
    innermost, then sequence, pipeline, data): its ranks share a node when this fits in one."""
    q = layout.grid
    if axis in ("2d_row", "2.5d_row", "3d_output"):
        return q
    if axis in ("2d_col", "2.5d_col", "3d_input"):
        return q * q
    if axis in ("tensor", "2.5d_dep", "3d_weight"):
        return layout.tensor
    if axis == "sequence":
        return layout.tensor * layout.sequence
    if axis == "pipeline":
        return layout.tensor * layout.sequence * layout.pipeline
    return layout.world


def base_axis(axis: str) -> str:
    """The mesh axis a ledger axis belongs to: a tensor mode's sub-axes are ``tensor``'s,
    ``data+sequence`` (the replicas) is ``data``'s."""
    if axis.startswith(("2d_", "2.5d_", "3d_")):
        return "tensor"
    return "data" if axis == "data+sequence" else axis


def _measured(links: dict[str, Link], op: str, group: int) -> Link | None:
    """Calibration's link of ``op`` for the measured group size nearest to ``group``."""
    kind = "p2p" if op in P2P else op
    sizes = [int(k.split(":")[1]) for k in links if k.startswith(kind + ":")]
    if not sizes:
        return None
    nearest = min(sizes, key=lambda n: (abs(math.log2(n) - math.log2(max(group, 1))), -n))
    return links[f"{kind}:{nearest}"]


def axis_link(cluster: Cluster, layout: Layout, axis: str, op: str = "all_reduce", group: int = 2) -> Link:
    """The link ``op`` on ``axis`` (a group of ``group`` ranks) runs over: ``cluster.axis_links``
    by the axis's name, then by its base axis's, then calibration's ``"OP:SIZE"`` entries (send and
    recv as ``p2p``, the nearest size), else ``intra`` when the group's span fits in a node."""
    links = cluster.axis_links
    if links:
        for key in (axis, base_axis(axis)):
            if key in links:
                return links[key]
        found = _measured(links, op, group)
        if found is not None:
            return found
    return cluster.intra if axis_span(layout, axis) <= cluster.devices_per_node else cluster.inter
