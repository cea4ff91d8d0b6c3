"""serving.py's split of the mean TTFT: the frontends' own spans read from their stats in process and from a
/metrics page, as `headrace serve` exports them, must agree."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from serving import frontend_spans, page_totals, span_means, stats_totals  # noqa: E402

from headrace.metrics.exporter import MetricsServer, frontend_collector  # noqa: E402
from headrace.metrics.stats import FrontendStats  # noqa: E402


def test_metrics_page_spans_match_the_frontends_stats():
    registry = CollectorRegistry()
    collector = frontend_collector(registry)
    servers = [FrontendStats("a"), FrontendStats("b")]  # two API servers' frontends on one page
    for s in servers:
        s.model_name = "m"
        collector.add(s)
    page = MetricsServer(registry)
    try:
        servers[0].on_first_token(10.0, 10.002, 10.010)
        before = page_totals(page.url)
        before_in_process = [stats_totals(s) for s in servers]
        servers[0].on_first_token(20.0, 20.004, 20.030)
        servers[1].on_first_token(30.0, 30.001, 30.006)
        servers[1].on_first_token(40.0, 40.0, 40.041)
        after = page_totals(page.url)
        after_in_process = [stats_totals(s) for s in servers]
    finally:
        page.close()
    spans = ("ttft", "queue", "prefill")
    summed = {k: (sum(t[k][0] for t in after_in_process), sum(t[k][1] for t in after_in_process)) for k in spans}
    for k in spans:
        total, count = after[k]
        assert count == summed[k][1] == 4
        assert math.isclose(total, summed[k][0], rel_tol=1e-9)
    assert after["ttft_le"] == tuple(map(sum, zip(*(t["ttft_le"] for t in after_in_process))))
    means = span_means(before, after)  # the three requests after `before`
    assert math.isclose(means["ttft"], (30 + 6 + 41) / 3, rel_tol=1e-9)
    assert math.isclose(means["queue"], (4 + 1 + 0) / 3, rel_tol=1e-9)
    assert math.isclose(means["prefill"], (26 + 5 + 41) / 3, rel_tol=1e-9)
    one = span_means(before_in_process[1], after_in_process[1])  # one frontend's stats alone
    assert math.isclose(one["ttft"], (6 + 41) / 2, rel_tol=1e-9)
    assert span_means(after, after) == {"ttft": None, "queue": None, "prefill": None}
    # The TTFT p99 of the three (30, 6 and 41 ms) is the slowest, 41 ms: the bucket bound 50 ms above it; of
    # 10 ms alone (before them), the bound 10 ms; of none, None.
    assert frontend_spans(before, after)["ttft_p99"] == frontend_spans(before_in_process[1], after_in_process[1])[
        "ttft_p99"] == 50.0
    assert frontend_spans({**before, "ttft_le": (0,) * len(before["ttft_le"])}, before)["ttft_p99"] == 10.0
    assert frontend_spans(after, after)["ttft_p99"] is None


def test_frontend_ttft_p99_is_the_bucket_of_the_ceil_99_percent_fastest():
    """Of 200 requests the p99 is the 198th fastest: 197 at 4 ms and three at 90 ms put it in (75, 100] ms;
    198 at 4 ms put it in (2.5, 5] ms."""
    for fast, want in ((197, 100.0), (198, 5.0)):
        stats = FrontendStats("a")
        stats.model_name = "m"
        before = stats_totals(stats)
        for i in range(200):
            stats.on_first_token(i, i, i + (0.004 if i < fast else 0.09))
        assert frontend_spans(before, stats_totals(stats))["ttft_p99"] == want
