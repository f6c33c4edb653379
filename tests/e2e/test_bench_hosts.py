"""``tessera bench hosts`` at its tiniest: one job on two namespace hosts (root needed) trains a
tiny GPT under dp4, ZeRO-3 and hybrid sharding, and writes well-formed rows with the planner's
prediction beside each. Speed is never asserted; the bytes are the algorithms'."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tessera.bench import hosts

METRICS = ["step_time_s", "inter_host_bytes", "wire_bytes", "predicted_step_s"]


def test_bench_hosts_writes_its_rows(tmp_path, monkeypatch):
    tiny = {"PRESET": "tiny", "SEQ": 16, "WARMUP": 1, "TIMED": 1, "CALIBRATE": False,
            "OVERRIDES": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4}}  # fmt: skip
    for name, value in tiny.items():
        monkeypatch.setattr(hosts, name, value)
    out = tmp_path / "hosts.json"
    assert hosts.main(argparse.Namespace(out=str(out))) == 0
    rows = json.loads(out.read_text())
    labels = [label for label, _ in hosts.LAYOUTS]
    assert [(r["name"], r["metric"]) for r in rows] == [
        (f"{label} 2x2 {hosts.RATE}", m) for label in labels for m in METRICS
    ]
    for r in rows:
        assert r["value"] > 0 and math.isfinite(r["ratio"]), r
        assert r["anchor"] == ("measured" if r["metric"] == "predicted_step_s" else "dp4"), r
    across = {r["name"].split(" 2x2")[0]: r["value"] for r in rows if r["metric"] == "inter_host_bytes"}
    # the ledger across hosts: hybrid sharding's shard all-reduce is 2/9 of ZeRO-3's gathers and scatters
    assert across["zero3 dp4 shard=host"] < across["zero3 dp4"] / 4
    details = json.loads(out.with_suffix(".details.json").read_text())
    assert details["results"]["hosts"] == [0, 0, 1, 1]
    ledger = details["results"]["layouts"][2]["ledger"]
    assert ledger["all_reduce@data.across"]["spans_hosts"] and not ledger["reduce_scatter@data.host"]["spans_hosts"]


def test_rates_read_as_tc_writes_them():
    assert hosts.rate_bytes("100mbit") == 12.5e6 and hosts.rate_bytes("1gbit") == 125e6
    with pytest.raises(ValueError, match="bits per second"):
        hosts.rate_bytes("100MB/s")
