"""Prometheus exporters: collectors over the plain stats structs, and an HTTP server.

Collectors run on the HTTP server's thread at scrape time and read a
snapshot of the stats (metrics/stats.py); the engine loop never touches a
prometheus_client object.
"""
from __future__ import annotations

import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from headrace.metrics import names
from headrace.metrics.stats import EngineStats, FrontendStats, Histogram


def _gauge(m: names.Metric, labels, values, value: float) -> GaugeMetricFamily:
    f = GaugeMetricFamily(m.name, m.help, labels=labels)
    f.add_metric(values, value)
    return f


def _counter(m: names.Metric, labels) -> CounterMetricFamily:
    assert m.name.endswith("_total")
    return CounterMetricFamily(m.name[: -len("_total")], m.help, labels=labels)


def _histogram(m: names.Metric, labels) -> HistogramMetricFamily:
    return HistogramMetricFamily(m.name, m.help, labels=labels)


def _add(family: HistogramMetricFamily, values, h: Histogram) -> None:
    family.add_metric(values, h.cumulative(), h.sum)


class EngineCollector:
    """The core's series for one EngineStats, labelled (model_name, engine)."""

    def __init__(self, stats: EngineStats, model_name: str, engine_id: str, quantization: str = "none",
                 startup: dict[str, float] | None = None) -> None:
        self._stats = stats
        self._values = [model_name, engine_id]
        self._quantization = quantization
        self._startup = dict(startup or {})  # phase -> seconds (EngineCore.startup)

    def collect(self):
        s, labels, v = self._stats.snapshot(), list(names.ENGINE_LABELS), self._values
        q = names.QUANTIZATION_INFO
        yield _gauge(q, labels + list(q.extra_labels), v + [self._quantization], 1)
        f = GaugeMetricFamily(names.STARTUP_SECONDS.name, names.STARTUP_SECONDS.help,
                              labels=labels + list(names.STARTUP_SECONDS.extra_labels))
        for phase, seconds in self._startup.items():
            f.add_metric(v + [phase], seconds)
        yield f
        yield _gauge(names.NUM_REQUESTS_RUNNING, labels, v, s.num_running)
        yield _gauge(names.NUM_REQUESTS_WAITING, labels, v, s.num_waiting)
        yield _gauge(names.KV_CACHE_USAGE, labels, v, s.kv_cache_usage)
        for m, value in ((names.PREFIX_CACHE_QUERIES, s.prefix_cache_queries),
                         (names.PREFIX_CACHE_HITS, s.prefix_cache_hits),
                         (names.NUM_PREEMPTIONS, s.num_preemptions),
                         (names.PROMPT_TOKENS, s.prompt_tokens),
                         (names.GENERATION_TOKENS, s.generation_tokens)):
            f = _counter(m, labels)
            f.add_metric(v, value)
            yield f
        for m, h in ((names.ITERATION_TOKENS, s.iteration_tokens), (names.STEP_DURATION, s.step_seconds)):
            f = _histogram(m, labels)
            _add(f, v, h)
            yield f


class FrontendCollector:
    """The request-level series of every frontend registered in one registry.

    Frontends sharing an application's registry appear as one family per
    metric with one label set per frontend (a registry must not hold two
    families of one name).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frontends: dict[str, FrontendStats] = {}  # frontend id -> its stats

    def add(self, stats: FrontendStats) -> None:
        with self._lock:
            self._frontends[stats.frontend_id] = stats

    def remove(self, stats: FrontendStats) -> None:
        with self._lock:
            self._frontends.pop(stats.frontend_id, None)

    def collect(self):
        with self._lock:
            snaps = [s.snapshot() for s in self._frontends.values()]
        snaps = [s for s in snaps if s.model_name is not None]
        labels = list(names.FRONTEND_LABELS)
        for m, attr in ((names.TIME_TO_FIRST_TOKEN, "ttft"), (names.INTER_TOKEN_LATENCY, "itl"),
                        (names.E2E_LATENCY, "e2e"), (names.QUEUE_TIME, "queue"),
                        (names.PREFILL_TIME, "prefill"), (names.DECODE_TIME, "decode"),
                        (names.REQUEST_PROMPT_TOKENS, "prompt_tokens"),
                        (names.REQUEST_GENERATION_TOKENS, "generation_tokens")):
            f = _histogram(m, labels)
            for s in snaps:
                _add(f, [s.model_name, s.frontend_id], getattr(s, attr))
            yield f
        f = _counter(names.REQUEST_SUCCESS, labels + list(names.REQUEST_SUCCESS.extra_labels))
        for s in snaps:
            for reason, n in sorted(s.success.items()):
                f.add_metric([s.model_name, s.frontend_id, reason], n)
        yield f
        f = _counter(names.HTTP_REQUESTS, labels + list(names.HTTP_REQUESTS.extra_labels))
        for s in snaps:
            for (route, status), n in sorted(s.http.items()):
                f.add_metric([s.model_name, s.frontend_id, route, status], n)
        yield f


_frontend_collectors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> FrontendCollector
_collectors_lock = threading.Lock()


def frontend_collector(registry: CollectorRegistry) -> FrontendCollector:
    """The registry's FrontendCollector, registered on first use."""
    with _collectors_lock:
        collector = _frontend_collectors.get(registry)
        if collector is None:
            collector = _frontend_collectors[registry] = FrontendCollector()
            registry.register(collector)
        return collector


class MetricsServer:
    """Serves one registry's /metrics on host:port (0 = a free port) from a daemon thread.

    Always in the Prometheus text format 0.0.4: prometheus_client's own
    server answers Prometheus' OpenMetrics Accept header with sample names
    whose colons are turned into underscores (their TYPE lines keep them),
    which breaks recording-rule-style names such as ours.
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"metrics port must be an int in [0, 65535], got {port!r}")
        self.registry = registry
        self._httpd = ThreadingHTTPServer((host, port), _handler(registry))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="headrace-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None


def _handler(registry: CollectorRegistry):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urlparse(self.path).path not in ("/", "/metrics"):
                self.send_error(404)
                return
            try:
                body = generate_latest(registry)
            except Exception:
                self.send_error(500, "error collecting metrics")
                raise
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # no access log on stderr
            pass

    return Handler


def merge_expositions(texts: list[str]) -> bytes:
    """One text exposition from several processes' (a core's and several
    frontends'): families of one name become one family holding every
    process's samples (they differ by their engine / frontend label)."""
    families: dict[str, object] = {}
    for text in texts:
        for f in text_string_to_metric_families(text):
            if f.name in families:
                families[f.name].samples.extend(f.samples)
            else:
                families[f.name] = f
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def check_metrics_options(metrics_port, metrics_registry) -> None:
    if metrics_port is not None and metrics_registry is not None:
        raise ValueError("give metrics_port (serve metrics on a port of their own) or metrics_registry "
                         "(register into your application's registry), not both")
    if metrics_registry is not None and not isinstance(metrics_registry, CollectorRegistry):
        raise TypeError(f"metrics_registry must be a prometheus_client CollectorRegistry, "
                        f"got {type(metrics_registry).__name__}")
