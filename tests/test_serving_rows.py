"""serving.py's Poisson rows: with --poisson-runs each HTTP run is set against AsyncEngine's run of the same number,
and a row a path and rate gives the median of the runs' figures, its HTTP ratio taken against AsyncEngine's medians."""
from __future__ import annotations

import random
import re
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from serving import number_runs, parse_args, percentiles, poisson_rows  # noqa: E402


def _run(path: str, rate: float, rng: random.Random, scale: float) -> tuple[dict, list[float], list[float]]:
    ttft = [rng.expovariate(1 / (0.012 * scale)) for _ in range(256)]
    itl = [rng.expovariate(1 / 0.002) for _ in range(2000)]
    r = {"path": path, "rate": rate, "requests": 256, "tokens": 150_000, "seconds": 12.0 * scale,
         "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
         "frontend_ms": {"ttft": 9.0 * scale, "queue": 2.5, "prefill": None}, "client_busy": 0.25 * scale}
    return r, ttft, itl


def test_runs_pair_by_number_and_medians_pair_with_medians():
    rng = random.Random(0)
    engine, http, samples = [], [], {}
    for i, scale in enumerate((1.0, 1.3, 0.8)):  # three runs at 24 req/s a path, then one at 8
        for path, runs in (("AsyncEngine", engine), ("headrace serve (HTTP, openai)", http)):
            r, ttft, itl = _run(path, 24.0, rng, scale * (1.4 if runs is http else 1.0))
            runs.append(r)
            number_runs(runs)
            samples[path, i + 1] = (ttft, itl)
    for path, runs in (("AsyncEngine", engine), ("headrace serve (HTTP, openai)", http)):
        runs.append(_run(path, 8.0, rng, 1.0)[0])
        number_runs(runs)
    rows = poisson_rows(engine + http)
    by_label = {(r["label"], r["rate"]): r for r in rows}
    assert len(rows) == 10  # 4 runs a path, and a median row a path at 24 req/s only
    assert {r["run"] for r in rows if r["rate"] == 8.0} == {1}
    assert by_label["AsyncEngine", 8.0]["label"] == "AsyncEngine"  # one run: no number in its label

    def p99(values):
        return float(np.percentile(values, 99)) * 1e3

    http_path = "headrace serve (HTTP, openai)"
    for i in (1, 2, 3):
        row = by_label[f"{http_path}, run {i}", 24.0]
        want = p99(samples[http_path, i][0]) / p99(samples["AsyncEngine", i][0])
        got = float(re.search(r"TTFT p99 ([0-9.]+)x", row["notes"]).group(1))
        assert got == pytest.approx(want, abs=0.006)
    engine_median = by_label["AsyncEngine, median of 3 runs", 24.0]
    http_median = by_label[f"{http_path}, median of 3 runs", 24.0]
    for row, path in ((engine_median, "AsyncEngine"), (http_median, http_path)):
        assert row["ttft_ms"][2] == pytest.approx(statistics.median(p99(samples[path, i][0]) for i in (1, 2, 3)))
        assert row["itl_ms"][2] == pytest.approx(statistics.median(p99(samples[path, i][1]) for i in (1, 2, 3)))
        assert row["frontend_ms"]["prefill"] is None
        assert row["client_busy"] == pytest.approx(statistics.median(
            0.25 * scale * (1.4 if path == http_path else 1.0) for scale in (1.0, 1.3, 0.8)))
    assert http_median["tok_s"] == pytest.approx(150_000 / (12.0 * 1.4))  # the median run's, scale 1.0
    want = http_median["ttft_ms"][2] / engine_median["ttft_ms"][2]
    assert f"TTFT p99 {want:.2f}x AsyncEngine's" in http_median["notes"]
    assert "TTFT p99 < 200 ms" in engine_median["notes"]


@pytest.mark.parametrize("flag", ["--poisson-runs", "--repeats"])
def test_run_counts_below_one_are_refused(flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["serving.py", "--parts", "poisson", flag, "0"])
    with pytest.raises(SystemExit):
        parse_args()
    assert f"{flag} takes a count >= 1, got 0" in capsys.readouterr().err
