"""The server's Prometheus metrics: counters, gauges and histograms in the text format.

Written here rather than taken from ``prometheus_client`` to keep ``tessera[serve]`` at two
dependencies. Every update and every render runs on the server's event loop, so nothing here
takes a lock. ``GET /metrics`` answers :meth:`ServerMetrics.render`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. Latency spans a short completion to a long one; the first token comes sooner.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# backend.stats() key -> (metric name, help). A gauge's name does not end in _total: the
# format keeps that suffix for counters.
ENGINE_GAUGES = {
    "running": ("tessera_requests_running", "Sequences the engine is generating for (holding KV blocks)."),
    "waiting": ("tessera_requests_waiting", "Sequences queued for the engine: new requests and preempted ones."),
    "kv_blocks_used": ("tessera_kv_blocks_used", "KV cache blocks held by sequences."),
    "kv_blocks_total": ("tessera_kv_blocks_capacity", "KV cache blocks in all."),
    "prefix_cache_hit_rate": (
        "tessera_prefix_cache_hit_rate",
        "Full prompt blocks found in the prefix cache over those looked up, since the start.",
    ),
    "prefix_cache_hit_blocks": ("tessera_prefix_cache_hit_blocks", "Full prompt blocks found in the prefix cache."),
    "prefix_cache_queried_blocks": (
        "tessera_prefix_cache_queried_blocks",
        "Full prompt blocks looked up in the prefix cache.",
    ),
    "preemptions": ("tessera_preemptions", "Sequences preempted (their blocks freed, computed again later)."),
    "step_tokens": ("tessera_step_tokens", "Tokens computed in the engine's last step (decodes and prompt chunks)."),
    "steps": ("tessera_engine_steps", "Steps the engine has run."),
}


def format_number(value: float) -> str:
    """A sample value as the format writes it: ``3``, ``0.25``, ``+Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    """Backslash, double quote and newline escaped, as the format asks inside ``"..."``."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    """``{a="1",b="x"}``, or ``""`` for no labels."""
    if not names:
        return ""
    pairs = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in zip(names, values))
    return "{" + pairs + "}"


def header(name: str, help_text: str, kind: str) -> list[str]:
    """The ``# HELP`` and ``# TYPE`` lines of one metric family."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonically increasing count per combination of label values."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (at least 0) to the series named by ``labels`` (all label names given)."""
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The series' current count (0 when never increased)."""
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = header(self.name, self.help_text, "counter")
        if not self.label_names and not self._values:
            return [*lines, f"{self.name} 0"]
        for key, value in sorted(self._values.items()):
            lines.append(f"{self.name}{format_labels(self.label_names, key)} {format_number(value)}")
        return lines

    def _key(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {list(self.label_names)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.label_names)


class Histogram:
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{self.__class__.__name__} {name}: buckets must increase, got {list(buckets)}")
        self.name = name
        self.help_text = help_text
        self.bounds = (*buckets, math.inf)
        self._bucket_counts = [0] * len(self.bounds)  # per bucket, not yet cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation into the first bucket whose bound is at least ``value``."""
        index = next(i for i, bound in enumerate(self.bounds) if value <= bound)
        self._bucket_counts[index] += 1
        self.count += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = header(self.name, self.help_text, "histogram")
        cumulative = 0
        for bound, count in zip(self.bounds, self._bucket_counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{format_number(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {format_number(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def gauge(name: str, help_text: str, value: float) -> list[str]:
    """One unlabelled gauge, read at render time (gauges here are snapshots, not kept state)."""
    return [*header(name, help_text, "gauge"), f"{name} {format_number(value)}"]


class ServerMetrics:
    """What the OpenAI-compatible server counts, and its ``/metrics`` page."""

    def __init__(self) -> None:
        self.requests = Counter(
            "tessera_requests_total",
            "HTTP requests by endpoint and status (a stream that ends in an error event counts "
            "as 500, a client that left before the end as 499).",
            ("endpoint", "status"),
        )
        self.prompt_tokens = Counter("tessera_prompt_tokens_total", "Prompt tokens of the requests sent to the engine.")
        self.generation_tokens = Counter("tessera_generation_tokens_total", "Tokens the engine generated.")
        self.latency = Histogram(
            "tessera_request_latency_seconds",
            "Seconds from a generation request's arrival to its last byte.",
            LATENCY_BUCKETS,
        )
        self.time_to_first_token = Histogram(
            "tessera_time_to_first_token_seconds",
            "Seconds from a generation request's arrival to its first generated token.",
            FIRST_TOKEN_BUCKETS,
        )

    def render(self, engine_stats: Mapping[str, float], in_flight: int) -> str:
        """The page: counters, histograms, the HTTP requests in flight and the engine's gauges
        (``engine_stats`` is ``backend.stats()``; keys other than :data:`ENGINE_GAUGES`' are left out)."""
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens):
            lines += metric.render()
        for histogram in (self.latency, self.time_to_first_token):
            lines += histogram.render()
        lines += gauge("tessera_http_requests_in_flight", "Generation requests being answered now.", in_flight)
        for key, (name, help_text) in ENGINE_GAUGES.items():
            if key in engine_stats:
                lines += gauge(name, help_text, float(engine_stats[key]))
        return "\n".join(lines) + "\n"
