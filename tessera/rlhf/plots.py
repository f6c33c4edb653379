"""Line plots of an alignment run's metrics, written as SVG by hand: no plotting library, small
text files that diff and render anywhere (a browser, GitHub, a docs page).

:func:`line_plot_svg` draws one chart: one polyline per series (markers too when a series has
few points, such as evaluations), axes with round-number ticks, a legend. :func:`plot_metrics`
turns the records of a ``metrics.jsonl`` file into one chart per :class:`Panel`; ``tessera
rlhf`` writes them into each stage's folder (:mod:`tessera.rlhf_pipeline`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from tessera.files import write_atomically

__all__ = ["Panel", "Series", "line_plot_svg", "nice_ticks", "plot_metrics", "write_line_plot"]

Series = tuple[str, Sequence[tuple[float, float]]]
"""A labelled line: ``(label, [(x, y), ...])``."""

# matplotlib's first colours (tab10): familiar, and apart for the common colour blindnesses
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
MARKERS_UP_TO = 40  # a series with at most this many points gets a dot at each


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) covering
    ``[low, high]``: the first at or below ``low``, the last at or above ``high``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"nice_ticks: the range must be finite, got [{low}, {high}]")
    if high < low:
        low, high = high, low
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step + 1e-9) * step
    last = math.ceil(high / step - 1e-9) * step
    n = round((last - first) / step)
    return [_clean(first + i * step, step) for i in range(n + 1)]


def _clean(value: float, step: float) -> float:
    """``value`` rounded to the step's decimals (0.30000000000000004 -> 0.3)."""
    decimals = max(0, -math.floor(math.log10(step)) + 1)
    return round(value, decimals) + 0.0  # + 0.0: no "-0"


def _label(value: float) -> str:
    return f"{value:.6g}"


def line_plot_svg(
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str = "step",
    ylabel: str = "",
    width: int = 640,
    height: int = 360,
) -> str:
    """The SVG text of a line chart of ``series`` (points that are not finite are left out; a
    series with none left is not drawn). Raises ValueError when no series has a finite point."""
    lines = [(label, [(float(x), float(y)) for x, y in pts if math.isfinite(x) and math.isfinite(y)])
             for label, pts in series]  # fmt: skip
    lines = [(label, pts) for label, pts in lines if pts]
    if not lines:
        raise ValueError(f"line_plot_svg({title!r}): no finite point to draw")
    xs = [x for _, pts in lines for x, _ in pts]
    ys = [y for _, pts in lines for _, y in pts]
    yticks = nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = min(xs), max(xs), yticks[0], yticks[-1]
    if x0 == x1:
        x0, x1 = x0 - 1.0, x1 + 1.0
    xticks = [x for x in nice_ticks(x0, x1) if x0 <= x <= x1]  # the x axis spans the data exactly
    left, right, top, bottom = 64, 16, 52, 46  # the legend goes in a row under the title
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return top + (1.0 - (y - y0) / (y1 - y0)) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2:.1f}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for y in yticks:
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + plot_w}" y2="{py(y):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{_label(y)}</text>')
    for x in xticks:
        out.append(f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{top + plot_h}" stroke="#f0f0f0"/>')
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{_label(x)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        out.append(
            f'<text x="14" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">{escape(ylabel)}</text>'
        )
    legend_x = float(left)
    for i, (label, pts) in enumerate(lines):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        if len(pts) <= MARKERS_UP_TO:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.8" fill="{colour}"/>' for x, y in pts]
        lx, ly = legend_x, 40.0  # the legend: a row under the title, outside the frame
        out.append(
            f'<line x1="{lx:.1f}" y1="{ly - 4}" x2="{lx + 18:.1f}" y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 24:.1f}" y="{ly}">{escape(label)}</text>')
        legend_x += 24 + 7 * len(label) + 18  # about 7 px a character at 12 px
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_line_plot(path: str | Path, series: Sequence[Series], **kwargs: Any) -> Path:
    """:func:`line_plot_svg` of ``series`` written to ``path`` atomically (its folder made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, line_plot_svg(series, **kwargs))


@dataclass(frozen=True)
class Panel:
    """One chart of a run's metrics: the file stem (``reward`` -> ``reward.svg``), its title and
    y-axis label, and its lines as ``(legend label, metrics key)`` pairs."""

    name: str
    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]


def plot_metrics(records: Sequence[Mapping[str, Any]], panels: Sequence[Panel], folder: str | Path) -> list[Path]:
    """One SVG per panel in ``folder`` from ``records`` (``metrics.jsonl`` lines: each with a
    ``step`` and any of the panel's keys). A panel none of whose keys has a finite value is
    skipped. Returns the files written."""
    written = []
    for panel in panels:
        series = []
        for label, key in panel.lines:
            points = [(float(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), int | float)]
            if any(math.isfinite(y) for _, y in points):
                series.append((label, points))
        if series:
            path = Path(folder) / f"{panel.name}.svg"
            written.append(write_line_plot(path, series, title=panel.title, ylabel=panel.ylabel))
    return written
