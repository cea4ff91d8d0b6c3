"""Prometheus metrics: one core and two frontends in real processes, scraped over HTTP,
counted against what was generated; a real Prometheus server; the Grafana dashboard."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from headrace import AsyncEngine, SamplingParams
from headrace.metrics import names
from tests.cores import start_core

DASHBOARD = Path(__file__).parent.parent / "metrics" / "grafana" / "headrace.json"
SHARED = "The river is low today and the boats wait at the pier for rain. " * 2  # prefix-cache hits


def scrape(port: int) -> dict[str, list]:
    """sample name -> [(labels, value)] of the /metrics page on 127.0.0.1:port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict, name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def start_core_with_metrics(model, address: str) -> tuple[subprocess.Popen, str, int]:
    proc, address = start_core(model, address, "--metrics-port", "0")
    metrics_line = proc.stdout.readline()
    m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", metrics_line)
    assert m, f"core did not print its metrics port: {metrics_line!r}"
    return proc, address, int(m.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A core and two frontends that ran requests; yields what they returned and their ports."""
    from headrace.testing import make_checkpoint
    from tests.conftest import ARCH_KWARGS

    tmp = tmp_path_factory.mktemp("metrics")
    model = make_checkpoint(tmp / "ckpt", "qwen3", **ARCH_KWARGS["qwen3"])
    proc, address, core_port = start_core_with_metrics(model, f"ipc://{tmp}/core.sock")
    prompts = {"a": ["Hello there", "今天天气很好", SHARED + "first"], "b": [SHARED + "second", [5, 6, 7, 8, 9]]}
    # The frontends' loop keeps running between tests (heartbeats), on a thread of its own.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    engines = {k: AsyncEngine.connect(address, metrics_port=0) for k in prompts}

    async def one(engine, prompt, max_tokens):
        final = None
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
            final = out
        return final

    async def run_all():
        results = {}
        for k, engine in engines.items():
            await engine.start()
        # A first wave, then the second shares its prompt prefix with cached blocks.
        results["a"] = await asyncio.gather(*(one(engines["a"], p, 6 + i) for i, p in enumerate(prompts["a"])))
        results["b"] = await asyncio.gather(*(one(engines["b"], p, 4 + i) for i, p in enumerate(prompts["b"])))
        deadline = time.monotonic() + 10
        while (s := await engines["a"].stats()).num_running or s.num_waiting:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        return results

    try:
        results = call(run_all())
        yield dict(results=results, core_port=core_port, frontend_ports={k: e.metrics_port for k, e in engines.items()},
                   frontend_ids={k: e.frontend_id for k, e in engines.items()})
    finally:
        for e in engines.values():
            call(e.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        proc.terminate()
        proc.wait(10)


def test_scraped_totals_match_generation(served):
    results = served["results"]
    core = scrape(served["core_port"])
    outs = [o for rs in results.values() for o in rs]
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert total(core, "headrace:generation_tokens_total") == gen
    assert total(core, "headrace:prompt_tokens_total") == prompt
    assert total(core, "headrace:num_requests_running") == 0
    assert total(core, "headrace:num_requests_waiting") == 0
    assert total(core, "headrace:kv_cache_usage_perc") == 0
    assert total(core, "headrace:prefix_cache_queries_total") == prompt  # no preemption here
    assert total(core, "headrace:prefix_cache_hits_total") >= 8  # SHARED's blocks, cached by the first wave
    assert total(core, "headrace:num_preemptions_total") == 0
    steps = total(core, "headrace:engine_step_duration_seconds_count")
    assert steps == total(core, "headrace:iteration_tokens_total_count") >= max(len(o.outputs[0].token_ids)
                                                                                for o in outs)
    # every computed token: prompts less cache hits, plus each generated token but the last of a request
    assert total(core, "headrace:iteration_tokens_total_sum") == \
        prompt - total(core, "headrace:prefix_cache_hits_total") + gen - len(outs)
    bucket = [v for labels, v in core["headrace:engine_step_duration_seconds_bucket"] if labels["le"] == "+Inf"]
    assert bucket == [steps]
    (labels, _), = core["headrace:generation_tokens_total"]
    assert set(labels) == {"model_name", "engine"}
    # the phases of the core's start (on the CPU, no CUDA graphs), as its log line gives them
    phases = {labels["phase"]: v for labels, v in core["headrace:startup_seconds"]}
    assert set(phases) == {"config", "weights", "memory profile", "kv pool and slots", "tokenizer"}
    assert all(v >= 0 for v in phases.values()) and phases["weights"] > 0

    for key, port in served["frontend_ports"].items():
        fe, mine = scrape(port), results[key]
        n = len(mine)
        tokens = sum(len(o.outputs[0].token_ids) for o in mine)
        assert total(fe, "headrace:request_success_total") == n
        by_reason = {labels["finished_reason"]: v for labels, v in fe["headrace:request_success_total"]}
        assert sum(by_reason.values()) == n and set(by_reason) <= {"stop", "length"}
        assert by_reason.get("length", 0) == sum(o.outputs[0].finish_reason == "length" for o in mine)
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                     "request_generation_tokens"):
            assert total(fe, f"headrace:{name}_count") == n, name
        assert total(fe, "headrace:inter_token_latency_seconds_count") == tokens - n
        assert total(fe, "headrace:request_generation_tokens_sum") == tokens
        assert total(fe, "headrace:request_prompt_tokens_sum") == sum(len(o.prompt_token_ids) for o in mine)
        ttft = total(fe, "headrace:time_to_first_token_seconds_sum")
        e2e = total(fe, "headrace:e2e_request_latency_seconds_sum")
        assert 0 < ttft <= e2e
        assert e2e == pytest.approx(ttft + total(fe, "headrace:request_decode_time_seconds_sum"), abs=1e-3)
        for o in mine:  # the core's timestamps, as RequestOutput.metrics carries them
            m = o.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        ids = {labels["frontend"] for labels, _ in fe["headrace:request_success_total"]}
        assert ids == {served["frontend_ids"][key]}


def test_metric_options_and_app_registry():
    with pytest.raises(ValueError, match="not both"):
        AsyncEngine.connect("ipc:///nonexistent", metrics_port=0, metrics_registry=CollectorRegistry())
    # Two frontends in one application registry: one family, one label set each.
    registry = CollectorRegistry()
    a = AsyncEngine.connect("ipc:///nonexistent", metrics_registry=registry)
    b = AsyncEngine.connect("ipc:///nonexistent", metrics_registry=registry)
    for e in (a, b):
        e._stats.model_name = "m"
        e._stats.success["stop"] += 1
    text = generate_latest(registry).decode()
    assert text.count("# TYPE headrace:request_success_total counter") == 1
    assert f'frontend="{a.frontend_id}"' in text and f'frontend="{b.frontend_id}"' in text
    a.shutdown()
    assert a.frontend_id not in generate_latest(registry).decode()
    b.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> float | None:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return None
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_prometheus_server_scrapes_the_totals(served, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        msg = "the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    targets = [f"127.0.0.1:{p}" for p in [served["core_port"], *served["frontend_ports"].values()]]
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "headrace", "static_configs": [{"targets": targets}]}],
    }))
    port = _free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    outs = [o for rs in served["results"].values() for o in rs]
    want_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    try:
        deadline = time.monotonic() + 40
        while True:
            up = _query(port, 'sum(up{job="headrace"})')
            got = (_query(port, "sum(headrace:generation_tokens_total)"),
                   _query(port, "sum(headrace:request_success_total)"),
                   _query(port, "sum(headrace:time_to_first_token_seconds_count)"))
            if up == 3 and got == (want_tokens, len(outs), len(outs)):
                break
            assert proc.poll() is None, f"prometheus exited: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, f"prometheus: up={up}, got {got}, want {want_tokens}, {len(outs)}"
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)


def test_dashboard_names_exist(served):
    dash = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "model_name", "instance"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"headrace:[a-z0-9_]+", e)}
    assert used, "no headrace metric in the dashboard"
    assert used <= set(names.BY_NAME), f"not declared in metrics/names.py: {used - set(names.BY_NAME)}"
    scraped = set(scrape(served["core_port"]))
    for port in served["frontend_ports"].values():
        scraped |= set(scrape(port))
    serve_only = {m.name for m in names.SERVE_METRICS}  # scraped in tests/test_http_api.py
    missing = [n for n in used - serve_only if n not in scraped and n + "_count" not in scraped]
    assert not missing, f"dashboard metrics missing from the scraped output: {missing}"
    # and every declared metric is exported (an API server's own, where one serves)
    exported = names.ENGINE_METRICS + names.FRONTEND_METRICS
    assert all(m.name in scraped or m.name + "_count" in scraped for m in exported)


def test_docs_list_every_metric():
    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    assert [m.name for m in names.ALL_METRICS if f"`{m.name}`" not in doc] == []
