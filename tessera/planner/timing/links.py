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


HOST_SPLIT = (".host", ".across")


def unsplit(axis: str) -> str:
    """The axis whose groups hybrid sharding split by node (``data`` of ``data.host`` and
    ``data.across``); any other axis itself."""
    for suffix in HOST_SPLIT:
        if axis.endswith(suffix):
            return axis[: -len(suffix)]
    return axis


def base_axis(axis: str) -> str:
    """The mesh axis a ledger axis belongs to: a tensor mode's sub-axes are ``tensor``'s,
    ``data+sequence`` (the replicas) is ``data``'s, and so are hybrid sharding's groups by node
    (``data.host``, ``data.across``)."""
    axis = unsplit(axis)
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


def spans_nodes(cluster: Cluster, layout: Layout, axis: str) -> bool:
    """Whether a group of ``axis`` has ranks on more than one node: hybrid sharding's
    ``<axis>.host`` never, its ``<axis>.across`` always (with more than one node), any other
    axis when its span is more than a node's ranks."""
    if axis.endswith(".host"):
        return False
    if axis.endswith(".across"):
        return cluster.nodes > 1
    return axis_span(layout, axis) > cluster.devices_per_node


def axis_link(cluster: Cluster, layout: Layout, axis: str, op: str = "all_reduce", group: int = 2) -> Link:
    """The link ``op`` on ``axis`` (a group of ``group`` ranks) runs over: ``cluster.axis_links``
    by the axis's name (and a whole axis's by its base axis's); else, for a group that spans
    nodes, ``inter``; else calibration's ``"OP:SIZE"`` entries (measured inside one node; send and
    recv as ``p2p``, the nearest size), else ``intra``."""
    links = cluster.axis_links
    for key in (axis,) if unsplit(axis) != axis else (axis, base_axis(axis)):
        if key in links:
            return links[key]
    if spans_nodes(cluster, layout, axis):
        return cluster.inter
    found = _measured(links, op, group) if links else None
    return found if found is not None else cluster.intra
