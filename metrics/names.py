"""Every Prometheus metric headrace exports: names, types, units, buckets.

Metric names are a public interface (dashboards and alerts use them): this
module is the only place that spells them. Both exporters, the tests and
docs/metrics.md follow it. Names are the exposed ones: counters end in
`_total`, histograms expose `_bucket`, `_sum` and `_count` series.

Core series carry the labels (model_name, engine); frontend series carry
(model_name, frontend). The engine/frontend ids are random per process, so
`sum by (model_name) (...)` adds up every core and every frontend.
"""
from __future__ import annotations

from dataclasses import dataclass

# Latencies from well under 10 ms (inter-token latency on a GPU) to tens of
# minutes (end-to-end latency of a long generation under load).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0,
    480.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0,
)
# Token counts per request or per step.
TOKEN_BUCKETS = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
)
# One engine step: a few hundred microseconds (small decode batch on a GPU)
# to seconds (a large prefill, or the CPU).
STEP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)

ENGINE_LABELS = ("model_name", "engine")
FRONTEND_LABELS = ("model_name", "frontend")


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed
    kind: str  # "gauge", "counter", "histogram"
    unit: str
    help: str
    buckets: tuple = ()
    extra_labels: tuple = ()  # beyond the process's (model_name, engine|frontend)


# ---- engine core (`headrace core --metrics-port`, CoreServer(metrics_port=)) ----
NUM_REQUESTS_RUNNING = Metric("headrace:num_requests_running", "gauge", "sequences",
                              "Sequences in the running batch (a request with n > 1 counts n).")
NUM_REQUESTS_WAITING = Metric("headrace:num_requests_waiting", "gauge", "sequences",
                              "Sequences waiting to be scheduled, preempted ones included.")
KV_CACHE_USAGE = Metric("headrace:kv_cache_usage_perc", "gauge", "ratio",
                        "Fraction of KV-cache blocks in use, 0 to 1 (1 = full).")
PREFIX_CACHE_QUERIES = Metric("headrace:prefix_cache_queries_total", "counter", "tokens",
                              "Prompt tokens looked up in the prefix cache at admission.")
PREFIX_CACHE_HITS = Metric("headrace:prefix_cache_hits_total", "counter", "tokens",
                           "Of the queried tokens, those found in the prefix cache.")
NUM_PREEMPTIONS = Metric("headrace:num_preemptions_total", "counter", "preemptions",
                         "Running sequences preempted (blocks freed, recomputed later).")
PROMPT_TOKENS = Metric("headrace:prompt_tokens_total", "counter", "tokens",
                       "Prompt tokens of sequences whose prefill completed (counted once per sequence, "
                       "prefix-cache hits included, recomputation after preemption not).")
GENERATION_TOKENS = Metric("headrace:generation_tokens_total", "counter", "tokens",
                           "Tokens sampled and sent to frontends.")
ITERATION_TOKENS = Metric("headrace:iteration_tokens_total", "histogram", "tokens",
                          "Tokens computed per engine step (prefill chunks plus decode tokens).",
                          buckets=TOKEN_BUCKETS)
STEP_DURATION = Metric("headrace:engine_step_duration_seconds", "histogram", "seconds",
                       "Wall time of one engine step (schedule, execute, update).", buckets=STEP_BUCKETS)
QUANTIZATION_INFO = Metric("headrace:quantization_info", "gauge", "",
                           "1, labelled with the quantization the engine's weights run in ('none', or e.g. "
                           "'awq (4-bit, group 128)').", extra_labels=("quantization",))
STARTUP_SECONDS = Metric("headrace:startup_seconds", "gauge", "seconds",
                         "Seconds each phase of the engine core's start took (config, weights, memory profile, "
                         "kv pool and slots, cuda graphs, tokenizer), labelled by phase.", extra_labels=("phase",))

ENGINE_METRICS = (
    QUANTIZATION_INFO, STARTUP_SECONDS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE, PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS, NUM_PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, ITERATION_TOKENS, STEP_DURATION,
)

# ---- frontend (AsyncEngine / LLM metrics_port= or metrics_registry=) ----
TIME_TO_FIRST_TOKEN = Metric("headrace:time_to_first_token_seconds", "histogram", "seconds",
                             "From arrival at the frontend to the core sampling the first token.",
                             buckets=LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Metric("headrace:inter_token_latency_seconds", "histogram", "seconds",
                             "Between the core steps that produced consecutive tokens of one sequence.",
                             buckets=LATENCY_BUCKETS)
E2E_LATENCY = Metric("headrace:e2e_request_latency_seconds", "histogram", "seconds",
                     "From arrival at the frontend to the request finishing.", buckets=LATENCY_BUCKETS)
QUEUE_TIME = Metric("headrace:request_queue_time_seconds", "histogram", "seconds",
                    "From arrival to the core first scheduling the request.", buckets=LATENCY_BUCKETS)
PREFILL_TIME = Metric("headrace:request_prefill_time_seconds", "histogram", "seconds",
                      "From first scheduled to the first token (all prefill chunks).", buckets=LATENCY_BUCKETS)
DECODE_TIME = Metric("headrace:request_decode_time_seconds", "histogram", "seconds",
                     "From the first token to the request finishing.", buckets=LATENCY_BUCKETS)
REQUEST_PROMPT_TOKENS = Metric("headrace:request_prompt_tokens", "histogram", "tokens",
                               "Prompt length of finished requests.", buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Metric("headrace:request_generation_tokens", "histogram", "tokens",
                                   "Tokens a finished request received, over all its n samples.",
                                   buckets=TOKEN_BUCKETS)
REQUEST_SUCCESS = Metric("headrace:request_success_total", "counter", "requests",
                         "Finished requests by finish reason (stop, length, abort).",
                         extra_labels=("finished_reason",))

HTTP_REQUESTS = Metric("headrace:http_requests_total", "counter", "requests",
                      "HTTP requests an API server of `headrace serve` answered, by route and status code "
                      "(routes it does not serve count as route \"other\"; 499: the client left first).",
                      extra_labels=("route", "status"))

# Labelled (model_name, process) only: headrace serve's parent counts them, and its API servers show them.
SERVE_RESTARTS = Metric("headrace:serve_restarts_total", "counter", "restarts",
                        "Children of `headrace serve` started again after they exited, by process (\"core\" or "
                        "\"api_server\").")

FRONTEND_METRICS = (
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_LATENCY, QUEUE_TIME, PREFILL_TIME, DECODE_TIME,
    REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, REQUEST_SUCCESS,
)
# Series only `headrace serve` shows (tests/test_http_api.py and tests/test_http_serve.py check them).
SERVE_METRICS = (HTTP_REQUESTS, SERVE_RESTARTS)

ALL_METRICS = ENGINE_METRICS + FRONTEND_METRICS + SERVE_METRICS
BY_NAME = {m.name: m for m in ALL_METRICS}
