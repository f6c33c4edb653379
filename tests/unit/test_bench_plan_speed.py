"""`tessera bench plan --scenarios`: the planner's time on the At-scale scenarios as rows (against
the 10 s bar and against one estimate measured in the same run); nothing about speed asserted."""

from __future__ import annotations

import argparse

import pytest

from tessera.bench import plan_speed
from tessera.cli import _cmd_bench
from tessera.errors import ConfigError


def test_scenario_rows_time_the_planner_against_the_bar_and_one_estimate():
    rows = plan_speed.scenario_rows(["colossal-vit-64"], repeats=1, estimate_repeats=2)
    assert [(r.name, r.metric, r.anchor) for r in rows] == [
        ("plan colossal-vit-64", "plan_time_s", "bar 10 s"),
        ("plan colossal-vit-64", "plan_time_s", "one estimate"),
        ("plan colossal-vit-64", "layouts_estimated", "shapes"),
    ]
    bar, per_estimate, counts = rows
    assert bar.anchor_value == plan_speed.BAR_S and bar.value == per_estimate.value > 0
    assert 0 < per_estimate.anchor_value < per_estimate.value  # one estimate is a part of the search
    assert counts.value >= 1 and counts.anchor_value >= 1


def test_scenarios_is_a_flag_of_the_plan_bench_only():
    args = argparse.Namespace(target="dp", tokens=None, calibrate=False, only=None, scenarios=True, out=None)
    with pytest.raises(ConfigError, match="--scenarios applies to `tessera bench plan` only"):
        _cmd_bench(args)
