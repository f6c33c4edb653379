"""The planner's explanations: the ranked table, why one layout ranks above another in terms of
its estimate's parts, the counts of the search, and the error that says by how much the nearest
layout misses when none fits."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError
from tessera.planner.estimate import Estimate
from tessera.planner.layout import Layout
from tessera.planner.spec import Cluster, ModelSpec, Workload

GIB = 2**30


@dataclass
class SearchStats:
    """How many layouts each stage of the search saw or dropped, and the time it took."""

    shapes: int = 0
    rejected: int = 0  # cannot run: Layout.problems() and the model's divisibility
    pruned_states: int = 0  # model states alone exceed device memory (no estimate made)
    too_big: int = 0  # estimated memory exceeds the device (memory only, no time)
    dominated: int = 0  # a lighter variant fits: skipped without estimating
    estimated: int = 0
    fitting: int = 0
    widened: bool = False  # tensor groups had to span nodes
    seconds: float = 0.0

    def describe(self) -> str:
        return (
            f"{self.shapes} shapes; {self.estimated} layouts estimated, {self.fitting} fit; skipped: "
            f"{self.rejected} cannot run, {self.pruned_states} by the model-state bound, {self.too_big} over memory, "
            f"{self.dominated} dominated; {self.seconds:.2f} s"
        )


def fmt_bytes(n: float, digits: int = 1) -> str:
    return f"{n / GIB:,.{digits}f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:,.{digits}f} MiB"


def fmt_over(need: float, limit: float) -> tuple[str, str]:
    """``need`` and ``limit`` with enough digits to tell them apart."""
    digits = next((d for d in (1, 2, 3) if fmt_bytes(need, d) != fmt_bytes(limit, d)), 3)
    return fmt_bytes(need, digits), fmt_bytes(limit, digits)


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def axis_span(layout: Layout, axis: str) -> int:
    """Consecutive ranks one group of ``axis`` spans (tensor innermost, then sequence, pipeline, data)."""
    inner = {"tensor": 1, "sequence": layout.tensor, "pipeline": layout.tensor * layout.sequence}
    size = {"tensor": layout.tensor, "sequence": layout.sequence, "pipeline": layout.pipeline, "data": layout.data}
    return layout.world if axis == "data" else inner[axis] * size[axis]


def link_of(layout: Layout, axis: str, cluster: Cluster) -> str:
    if axis in cluster.axis_links:
        return "measured link"
    return "across nodes" if axis_span(layout, axis) > cluster.devices_per_node else "within a node"


def _traffic_words(model: ModelSpec, layout: Layout, workload: Workload, axis: str) -> str:
    """The two largest ops on ``axis`` (its sub-axes summed: 2d rows and columns are the tensor
    axis) in one step on the busiest rank, as the ledger counts them: ``all-gathers of 140.0 GiB``."""
    from tessera.planner.timing import base_axis, step_traffic

    ops: dict[str, float] = {}
    for t in step_traffic(model, layout, workload).values():
        if base_axis(t.axis) == axis:
            ops[t.op] = ops.get(t.op, 0.0) + t.bytes
    top = sorted(((nbytes, op) for op, nbytes in ops.items() if nbytes > 0), reverse=True)[:2]
    return " + ".join(f"{op.replace('_', '-')}s of {fmt_bytes(nbytes)}" for nbytes, op in top)


def _comm_part(a: Estimate, b: Estimate, plan: Plan) -> str:
    """Exposed communication of ``a`` against ``b``, and the axis whose traffic time fell most."""
    text = f"exposed communication {fmt_time(a.time.exposed_comm)} vs {fmt_time(b.time.exposed_comm)}"
    gains = {ax: b.time.comm.get(ax, 0.0) - a.time.comm.get(ax, 0.0) for ax in set(a.time.comm) | set(b.time.comm)}
    if not gains or max(gains.values()) <= 0:
        return text
    ax = max(sorted(gains), key=lambda k: gains[k])
    before, after = b.time.comm.get(ax, 0.0), a.time.comm.get(ax, 0.0)
    words = _traffic_words(plan.model, b.layout, plan.workload, ax)
    theirs = f"{words} a step {link_of(b.layout, ax, plan.cluster)}" if words else link_of(b.layout, ax, plan.cluster)
    if after == 0:
        return text + f" (no {ax}-axis traffic vs {fmt_time(before)}: {theirs})"
    return text + f" ({ax}-axis traffic {fmt_time(after)} vs {fmt_time(before)}: {theirs})"


def why(a: Estimate, b: Estimate, label: str, plan: Plan) -> str:
    """Why ``a`` ranks above ``b``, in terms of the estimate's parts: memory when ``b`` does not fit,
    else the parts of the step time that differ most."""
    if a.layout == b.layout:
        return f"it is the {label} layout"
    if not b.fits:
        need, available = fmt_over(b.memory.peak, plan.cluster.device_memory)
        return f"vs {label}: fits ({label} needs {need} per rank, {available} available)"
    gain = b.time.step - a.time.step
    if gain <= 0:
        less = b.memory.peak - a.memory.peak
        if less <= 0:
            return f"vs {label}: a tie (the same step time and memory)"
        return f"vs {label}: the same step time, {fmt_bytes(less)} less memory per rank"
    parts = {
        "exposed communication": b.time.exposed_comm - a.time.exposed_comm,
        "bubble": b.time.bubble - a.time.bubble,
        "compute": b.time.compute - a.time.compute,
        "optimizer": b.time.optimizer - a.time.optimizer,
    }
    main = [k for k in sorted(parts, key=lambda k: -parts[k]) if parts[k] > 0.1 * gain][:2]
    words = {
        "exposed communication": lambda: _comm_part(a, b, plan),
        "bubble": lambda: f"pipeline bubble {fmt_time(a.time.bubble)} vs {fmt_time(b.time.bubble)}",
        "compute": lambda: f"compute {fmt_time(a.time.compute)} vs {fmt_time(b.time.compute)} (recomputation)",
        "optimizer": lambda: f"optimizer step {fmt_time(a.time.optimizer)} vs {fmt_time(b.time.optimizer)}",
    }
    detail = "; ".join(words[k]() for k in main) or "a little in every part"
    share = 100 * gain / b.time.step
    return f"vs {label}: {share:.2g}% shorter step ({fmt_time(a.time.step)} vs {fmt_time(b.time.step)}): {detail}"


@dataclass(frozen=True)
class Row:
    """One line of the table: a ranked layout (``rank`` 1, 2, ...) or a baseline (``rank`` None)."""

    rank: int | None
    estimate: Estimate
    label: str
    why: str


@dataclass
class Plan:
    """The outcome of :func:`plan`: every layout that fits, fastest first (``ranked``), the best
    layout of each baseline family (``baselines``: name -> estimate, None when the family cannot
    run), and when nothing fits the layout that misses by least (``nearest``)."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    ranked: list[Estimate]
    baselines: dict[str, Estimate | None]
    stats: SearchStats
    top: int = 10
    nearest: Estimate | None = None
    reported: frozenset[str] = frozenset()

    @property
    def best(self) -> Estimate:
        """The fastest layout that fits; ConfigError saying by how much the nearest misses if none does."""
        if self.ranked:
            return self.ranked[0]
        limit = self.cluster.device_memory
        if self.nearest is None:
            raise ConfigError(f"no layout of {self.cluster.devices} devices can run {self.model.name}")
        need, available = fmt_over(self.nearest.memory.peak, limit)
        raise ConfigError(
            f"no layout of {self.model.name} fits {self.cluster.devices} devices of {available}: the nearest, "
            f"{self.nearest.layout.name()}, needs {need} per rank ({fmt_bytes(self.nearest.memory.peak - limit)} over; "
            "more devices, more memory, a smaller global batch or sequence would help)"
        )

    def reasons(self, index: int = 0) -> list[str]:
        """Why ``ranked[index]`` wins: against the next one and against each baseline."""
        a = self.ranked[index]
        out = []
        if index + 1 < len(self.ranked):
            out.append(why(a, self.ranked[index + 1], f"#{index + 2}", self))
        for name, b in self.baselines.items():
            if b is not None:
                out.append(why(a, b, name, self))
        return out

    def rows(self) -> list[Row]:
        rows = []
        shown = self.ranked[: self.top]
        for i, est in enumerate(shown):
            label = ", ".join(n for n, b in self.baselines.items() if b is not None and b.layout == est.layout)
            nxt = why(est, self.ranked[i + 1], f"#{i + 2}", self) if i + 1 < len(self.ranked) else "the last that fits"
            rows.append(Row(i + 1, est, label, nxt))
        best = self.ranked[0] if self.ranked else None
        for name, b in self.baselines.items():
            if b is None or any(b.layout == r.estimate.layout for r in rows):
                continue
            reason = why(best, b, name, self) if best is not None else "nothing fits"
            rows.append(Row(None, b, name, reason.removeprefix(f"vs {name}: ")))
        return rows

    def table(self, markdown: bool = False) -> str:
        """The ranked table (plain text, or markdown), baselines below the ranked rows."""
        head = ["rank", "layout", "peak mem/rank", "step", "samples/s", "comm exposed", "bubble", "fits", "why"]
        body = []
        for row in self.rows():
            e = row.estimate
            rank = str(row.rank) if row.rank is not None else ("paper" if row.label in self.reported else "base")
            name = e.layout.name() + (f" [{row.label}]" if row.label else "")
            body.append([rank, name, fmt_bytes(e.memory.peak), fmt_time(e.time.step), f"{e.samples_per_s:,.1f}",
                         fmt_time(e.time.exposed_comm), fmt_time(e.time.bubble), "yes" if e.fits else "NO", row.why])  # fmt: skip
        if markdown:
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in body]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
        fmt = "  ".join(f"{{:{'>' if i in (2, 3, 4, 5, 6) else '<'}{w}}}" for i, w in enumerate(widths)) + "  {}"
        return "\n".join(fmt.format(*r) for r in [head, *body])

    def summary(self) -> str:
        """One or two lines: the chosen layout, its prediction and why."""
        best = self.best
        head = (
            f"{best.layout.name()}: predicted {fmt_time(best.time.step)} a step, {best.samples_per_s:,.1f} samples/s, "
            f"{fmt_bytes(best.memory.peak)} per rank of {fmt_bytes(self.cluster.device_memory)}"
        )
        reasons = self.reasons(0)
        m = best.memory
        if self.model.adapters is not None:  # LoRA: what trains and what only sits on the rank
            trainable = m.parameters + m.gradients + m.optimizer_states
            head += (
                f"\n  model states per rank: trainable {fmt_bytes(trainable)} (parameters {fmt_bytes(m.parameters)}, "
                f"gradients {fmt_bytes(m.gradients)}, optimizer {fmt_bytes(m.optimizer_states)}), frozen base "
                f"{fmt_bytes(m.frozen)} (weights only)"
            )
        return head + ("\n  " + "; ".join(reasons) if reasons else "")
