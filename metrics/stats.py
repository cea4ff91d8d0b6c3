"""Plain stats structs, updated by the engine loop and the frontends.

Nothing here imports prometheus_client: the owner (the core's busy loop,
a frontend's receive task) updates these under a short lock, and an
exporter thread copies a snapshot at scrape time (metrics/exporter.py).
"""
from __future__ import annotations

import bisect
import copy
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields

from headrace.metrics import names


class Histogram:
    """Bucket counts (non-cumulative, one per upper bound plus +Inf) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # [num_bounds + 1], last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)] in Prometheus' form, +Inf last."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out

    def __deepcopy__(self, memo) -> Histogram:
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum = self.bounds, list(self.counts), self.sum
        return h


class Laps:
    """Seconds of the named phases of a start-up, in order: lap(name) ends the
    phase that ran since the previous lap (or since construction)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())


@dataclass
class EngineStats:
    """The engine core's series; EngineCore.step writes, the exporter reads snapshot()."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(names.ITERATION_TOKENS.buckets))
    step_seconds: Histogram = field(default_factory=lambda: Histogram(names.STEP_DURATION.buckets))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> EngineStats:
        with self.lock:
            return _copy_without_lock(self)


@dataclass
class FrontendStats:
    """One frontend's request-level series; the frontend writes, the exporter reads snapshot()."""

    frontend_id: str
    model_name: str | None = None  # known after the handshake; not exported before
    ttft: Histogram = field(default_factory=lambda: Histogram(names.TIME_TO_FIRST_TOKEN.buckets))
    itl: Histogram = field(default_factory=lambda: Histogram(names.INTER_TOKEN_LATENCY.buckets))
    e2e: Histogram = field(default_factory=lambda: Histogram(names.E2E_LATENCY.buckets))
    queue: Histogram = field(default_factory=lambda: Histogram(names.QUEUE_TIME.buckets))
    prefill: Histogram = field(default_factory=lambda: Histogram(names.PREFILL_TIME.buckets))
    decode: Histogram = field(default_factory=lambda: Histogram(names.DECODE_TIME.buckets))
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(names.REQUEST_PROMPT_TOKENS.buckets))
    generation_tokens: Histogram = field(
        default_factory=lambda: Histogram(names.REQUEST_GENERATION_TOKENS.buckets))
    success: Counter = field(default_factory=Counter)  # finish reason -> requests
    http: Counter = field(default_factory=Counter)  # (route, status) -> HTTP requests answered
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> FrontendStats:
        with self.lock:
            return _copy_without_lock(self)

    def on_first_token(self, arrival: float, first_scheduled: float | None, first_token: float) -> None:
        with self.lock:
            self.ttft.observe(max(first_token - arrival, 0.0))
            if first_scheduled is not None:
                self.queue.observe(max(first_scheduled - arrival, 0.0))
                self.prefill.observe(max(first_token - first_scheduled, 0.0))

    def on_http(self, route: str, status: int) -> None:
        with self.lock:
            self.http[route, str(status)] += 1

    def on_token_gaps(self, gaps) -> None:
        with self.lock:
            for g in gaps:
                self.itl.observe(max(g, 0.0))

    def on_finished(self, reason: str, arrival: float, first_token: float | None, finished: float,
                    num_prompt_tokens: int, num_generation_tokens: int) -> None:
        with self.lock:
            self.success[reason] += 1
            self.e2e.observe(max(finished - arrival, 0.0))
            if first_token is not None:
                self.decode.observe(max(finished - first_token, 0.0))
            self.prompt_tokens.observe(num_prompt_tokens)
            self.generation_tokens.observe(num_generation_tokens)


def _copy_without_lock(stats):
    """A deep copy of a stats dataclass with a fresh lock (the caller holds the old one)."""
    values = {f.name: copy.deepcopy(getattr(stats, f.name)) for f in fields(stats) if f.name != "lock"}
    return type(stats)(**values)
