"""The compile report of a run: what dynamo compiled in each region, said once after the first
step (when every block has run forward and backward) and kept in the run folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tessera.engine.hooks import Hook, TrainingLoop, print_beside_bars
from tessera.files import write_atomically


class CompileReportHook(Hook):
    """Rank 0 prints the engine's compile report after the first step (graphs, graph breaks and
    recompilations per compiled region, with reasons, and how long compiling took) and again if
    a later step compiled anything new; at the end it writes the report to ``path`` as JSON."""

    priority = 80

    def __init__(self, path: Path | None = None, printer: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.printer = printer or print_beside_bars
        self._said: dict[str, tuple[int, dict[str, int], int]] = {}

    def after_step(self, trainer: TrainingLoop) -> None:
        report = trainer.engine.compile_report
        if report is None or trainer.engine.ctx.rank != 0:
            return
        now = {name: (s.graphs, dict(s.breaks), len(s.recompiles)) for name, s in report.regions.items()}
        if now == self._said:
            return
        self._said = now
        self.printer(f"compiled regions after step {trainer.engine.global_step}:")
        for line in report.lines():
            self.printer("  " + line)

    def after_fit(self, trainer: TrainingLoop) -> None:
        report = trainer.engine.compile_report
        if report is not None and self.path is not None and trainer.engine.ctx.rank == 0:
            write_atomically(self.path, json.dumps(report.as_dict(), indent=2) + "\n")
