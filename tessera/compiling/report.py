"""What compiling did, per compiled region: graphs captured, graph breaks with their reasons,
recompilations with theirs, compile time, and whether a region ran eagerly instead.

Read from dynamo's own records (``torch._dynamo.utils.counters`` and its compilation metrics)
around each call of a region, so that a break or a recompilation is charged to the block in
which it happened. A region whose call captured no graph at all falls back to eager: that is
said once, with the reasons (``warnings``), and kept in the report.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RegionStats:
    """One compiled region's record."""

    name: str
    calls: int = 0
    graphs: int = 0  # frames compiled into graphs (one per piece between breaks, per recompilation)
    breaks: Counter[str] = field(default_factory=Counter)  # reason -> times
    recompiles: list[str] = field(default_factory=list)  # the guard failures that caused them
    failures: list[str] = field(default_factory=list)  # frames dynamo could not compile (run eagerly)
    compile_s: float = 0.0
    cache_hits: int = 0  # graphs found in the local compile cache (a warm start)
    eager: bool = False  # its first call captured no graph: it runs eagerly

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "graphs": self.graphs,
            "graph_breaks": dict(self.breaks),
            "recompiles": list(self.recompiles),
            "failures": list(self.failures),
            "compile_s": round(self.compile_s, 3),
            "cache_hits": self.cache_hits,
            "eager": self.eager,
        }


def short(reason: str) -> str:
    """A dynamo reason in one line: its title and its explanation (the hints and links dropped)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return reason
    explanation = next(
        (line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), ""
    )
    return f"{lines[0]}: {explanation}" if explanation else lines[0]


def _dynamo_state() -> tuple[Counter[str], set[int]]:
    """Dynamo's graph-break counts, and its compilation records (a bounded queue: the records
    new since are those not seen before, not those past the old length)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    return Counter(counters["graph_break"]), {id(m) for m in get_compilation_metrics()}


class CompileReport:
    """The records of every compiled region of a run, by name, in the order they first ran."""

    def __init__(self) -> None:
        self.regions: dict[str, RegionStats] = {}

    @contextlib.contextmanager
    def watching(self, name: str) -> Iterator[None]:
        """Charge what dynamo compiles in the ``with`` block to region ``name``."""
        stats = self.regions.setdefault(name, RegionStats(name))
        first = stats.calls == 0
        stats.calls += 1
        breaks_before, seen = _dynamo_state()
        yield
        from torch._dynamo.utils import counters, get_compilation_metrics

        stats.breaks.update(Counter(counters["graph_break"]) - breaks_before)
        new = [m for m in get_compilation_metrics() if id(m) not in seen]
        for m in new:
            if m.fail_reason:
                stats.failures.append(str(m.fail_reason))
            if m.graph_op_count:
                stats.graphs += 1
            if m.recompile_reason:
                stats.recompiles.append(str(m.recompile_reason))
            stats.compile_s += m.entire_frame_compile_time_s or 0.0
            stats.cache_hits += (m.inductor_fx_local_cache_hit_count or 0) + (m.aotautograd_local_cache_hit_count or 0)
        if first and new and stats.graphs == 0:
            stats.eager = True
            why = "; ".join(short(r) for r in [*stats.failures, *stats.breaks]) or "dynamo captured no graph"
            warnings.warn(f"compiled region {name} runs eagerly: {why}", stacklevel=2)

    @property
    def graph_breaks(self) -> Counter[str]:
        """Every region's breaks together, reason -> times."""
        total: Counter[str] = Counter()
        for stats in self.regions.values():
            total.update(stats.breaks)
        return total

    def as_dict(self) -> dict[str, Any]:
        return {name: stats.as_dict() for name, stats in self.regions.items()}

    def lines(self) -> list[str]:
        """A short text report: one line per region, then each break and recompilation reason."""
        out = []
        for stats in self.regions.values():
            if stats.eager:
                state = "eager (fell back)"
            elif stats.graphs == 0 and not stats.breaks and not stats.failures:
                state = "the graph of an earlier region of its shape"
            else:
                state = f"{stats.graphs} graph(s)"
            out.append(
                f"{stats.name}: {state}, {sum(stats.breaks.values())} graph break(s), "
                f"{len(stats.recompiles)} recompilation(s), compiled in {stats.compile_s:.2f} s"
                + (f" ({stats.cache_hits} from the cache)" if stats.cache_hits else "")
            )
            out += [f"  break x{n}: {short(reason)}" for reason, n in stats.breaks.items()]
            out += [f"  recompiled: {short(reason)}" for reason in stats.recompiles]
            out += [f"  not compiled: {short(reason)}" for reason in stats.failures]
        return out
