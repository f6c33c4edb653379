"""Benchmarks against the anchor systems, measured side by side in the same run.

Each benchmark reports rows ``{name, metric, value, anchor, anchor_value, ratio}`` where
``ratio = value / anchor_value``; both sides run on the same ranks, model and data, in
alternating blocks, so the noise of a shared machine falls on both alike.
"""

from tessera.bench.report import Row, print_rows, write_rows

__all__ = ["Row", "print_rows", "write_rows"]
