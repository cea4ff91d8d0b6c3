"""Minutes of mixed load through the openai client against `headrace serve`,
with an API server and then the engine core killed in the middle; checks
that nothing is lost.

    python3 benchmarks/soak.py [--model PATH] [--device auto] [--minutes 10] [--clients 16]
                               [--api-servers 2] [--max-model-len 1024] [--seed 0] [--json PATH]

--model defaults to the Qwen3-0.6B shape on a GPU (benchmarks_common) and to
the SmolLM2-135M-Instruct GGUF on a CPU. First every kind of request below
is sent a few times (not counted: what a first request of a kind builds is
warm-up). Then --clients threads each send one request after another, every
one through the openai client with a 120 s timeout, drawn at random
(random.Random(seed + client)), waiting Retry-After (at most 2 s) after a
503 that gives it:
- completions or chat, streamed or whole (half each), max_tokens 8..64;
- 20% ask for logprobs (2; top_logprobs for chat), 15% n=2, 15% a stop string;
- 10% a prompt near max_model_len (so prompt + max_tokens fill the context);
- 10% of the streamed ones disconnect after two chunks;
- 1% an invalid body (temperature -1), which must get a 400.
At a fifth of the time one API server is killed (SIGKILL), at two fifths the
core; the rest of the run is steady load again. Where the restarted core is
slow to serve again, the load goes on past --minutes (up to twice as long)
until the memory check below has a sample 10 s or more into its window.
Each request ends as one of:
  ok           the full output: every choice finished ("length" with all of
               max_tokens, or "stop"), and for streams [DONE] after it;
  refused      an HTTP error with a message (400 for the invalid bodies; 503
               while the core restarts, or for requests running when it died);
  dropped      the connection was cut (its API server was killed);
  disconnected the client left on purpose;
  hung         no end within the timeout;  bad: anything else.
Checks (exit status 1 if one fails):
- no request hung or ended bad, and no invalid body got other than 400;
- after the load, with no request running, the core's KV pool is back to
  all its blocks free (AsyncEngine.connect to the core's address);
- resident memory (VmRSS, sampled every 10 s) of each process alive at the
  end grew less than 5% from its first sample after three fifths of the run
  (the warm-up, and the load settled again after the restarts), or SETTLE_S
  after the first request that began after the core's kill and succeeded if
  that is later, to its last; with fewer than two samples there, the check
  fails rather than passing unchecked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import openai

TIMEOUT = 120.0
FAULT_AT = (0.2, 0.4)  # an API server, then the core, killed at these fractions of the run
STEADY_FROM = 0.6  # resident memory is compared from this fraction of the run to its end
SETTLE_S = 10.0  # or from this long after the restarted core's first success, if later


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--api-servers", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not args.minutes > 0 or args.clients < 1:
        parser.error(f"--minutes must be > 0 and --clients >= 1, got {args.minutes} and {args.clients}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.model or _default_model(device)
    serve = _Serve(model, device, args)
    try:
        report = _soak(serve, args)
    finally:
        serve.stop()
    report["serve_exit_code"] = serve.proc.returncode
    failures = _check(report)
    _print(report, failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failures else 0


def _default_model(device: str) -> str:
    if device == "cuda":
        from benchmarks_common import qwen3_06b_checkpoint

        return str(qwen3_06b_checkpoint())
    from headrace.checkpoint.smollm2 import smollm2_gguf

    return str(smollm2_gguf())


class _Serve:
    def __init__(self, model: str, device: str, args) -> None:
        cmd = [sys.executable, "-m", "headrace.frontend.cli", "serve", "--model", model, "--port", "0",
               "--device", device, "--api-servers", str(args.api_servers), "--max-model-len", str(args.max_model_len),
               "--served-model-name", "soak"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        first, second = self.proc.stdout.readline(), self.proc.stdout.readline()
        m = re.search(r"at (http://\S+/v1)", first)
        if m is None or " at " not in second:
            self.stop()
            raise RuntimeError(f"headrace serve did not start: {first!r} {second!r}")
        self.base_url = m.group(1)
        self.core_address = second.split(" at ", 1)[1].split()[0]

    def children(self) -> dict[int, str]:
        """pid -> "core" or "api" for serve's children."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        roles = {}
        for pid in map(int, out.split()):
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    roles[pid] = "core" if " core " in f.read().replace("\0", " ") else "api"
            except FileNotFoundError:
                pass
        return roles

    def stop(self) -> None:
        from headrace.lifetime import terminate

        terminate(self.proc, 60)


def _soak(serve: _Serve, args) -> dict:
    tokenizer = _tokenizer(serve)
    long_prompt = tokenizer(args.max_model_len - 72)
    long_chat = _long_chat(serve, args.max_model_len - 72)
    # Every kind of request, on fresh connections (so likely to every API server), before the clock
    # starts: what a first request of a kind builds (chat template, logprob token texts) is warm-up.
    for i in range(4 * args.api_servers):
        for chat in (False, True):
            kind = {"chat": chat, "stream": i % 2 == 0, "max_tokens": 4, "logprobs": True, "n": 2, "stop": True,
                    "long": i < 2, "leave": False, "invalid": False}
            _one(openai.OpenAI(base_url=serve.base_url, api_key="none", max_retries=0, timeout=TIMEOUT), kind,
                 long_prompt, long_chat)
    start = time.monotonic()
    end = start + args.minutes * 60
    results: list[dict] = []
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=_client, args=(serve.base_url, random.Random(args.seed + i), long_prompt,
                                                      long_chat, results, lock, stop), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    memory: dict[int, list[tuple[float, float, str]]] = {}  # pid -> [(seconds, VmRSS MiB, role)]
    faults = [(FAULT_AT[0], "api"), (FAULT_AT[1], "core")]
    events = []
    next_sample = start
    while True:
        now = time.monotonic()
        if now >= end + args.minutes * 60:  # twice the run: the memory check says what it could not compare
            break
        if now >= end:
            with lock:
                steady = _steady_from(results, events, start, end)
            if now - start >= steady + 10:  # a periodic sample in the window; the last comes after the loop
                break
        if faults and now - start >= faults[0][0] * (end - start):
            _, role = faults.pop(0)
            victim = next(pid for pid, r in sorted(serve.children().items()) if r == role)
            os.kill(victim, signal.SIGKILL)
            events.append({"at": round(now - start, 1), "killed": role, "pid": victim})
        if now >= next_sample:
            next_sample += 10
            for pid, role in [(serve.proc.pid, "serve"), *serve.children().items()]:
                rss = _rss_mib(pid)
                if rss is not None:
                    memory.setdefault(pid, []).append((now - start, rss, role))
        time.sleep(0.1)
    load_s = time.monotonic() - start
    stop.set()
    for t in threads:
        t.join(TIMEOUT + 10)
    hung_threads = sum(t.is_alive() for t in threads)
    for pid, role in [(serve.proc.pid, "serve"), *serve.children().items()]:
        rss = _rss_mib(pid)
        if rss is not None:
            memory.setdefault(pid, []).append((time.monotonic() - start, rss, role))
    steady = _steady_from(results, events, start, end)
    alive = set(serve.children()) | {serve.proc.pid}
    growth, unchecked = {}, []
    for pid, samples in memory.items():
        later = [s for s in samples if s[0] >= steady]
        if pid in alive and len(later) >= 2:
            growth[f"{samples[0][2]} {pid}"] = round(later[-1][1] / later[0][1] - 1, 4)
        elif pid in alive:
            unchecked.append(f"{samples[0][2]} {pid}")
    return {"minutes": args.minutes, "load_s": round(load_s, 1), "clients": args.clients,
            "events": events, "requests": results,
            "hung_threads": hung_threads, "rss_growth": growth, "rss_from": round(steady, 1),
            "rss_unchecked": unchecked, "kv": asyncio.run(_kv_state(serve.core_address))}


def _steady_from(results: list[dict], events: list[dict], start: float, end: float) -> float:
    """Seconds into the run from which resident memory is compared."""
    return max(STEADY_FROM * (end - start), _back_at(results, events, start) + SETTLE_S)


def _back_at(results: list[dict], events: list[dict], start: float) -> float:
    """Seconds into the run when the first request begun after the core's kill succeeded (inf: none did)."""
    killed = next((e["at"] for e in events if e["killed"] == "core"), None)
    if killed is None:
        return 0.0
    ends = [r["began"] + r["seconds"] - start for r in results if r["outcome"] == "ok" and r["began"] - start >= killed]
    return min(ends, default=float("inf"))


def _tokenizer(serve: _Serve):
    """n -> a prompt of n tokens (token ids within the vocabulary of the served model)."""
    async def vocab() -> int:
        from headrace import AsyncEngine

        async with AsyncEngine.connect(serve.core_address) as engine:
            return engine.info.vocab_size

    size = asyncio.run(vocab())
    return lambda n: [(7 * i + 11) % min(size, 5000) + 10 for i in range(n)]


def _long_chat(serve: _Serve, tokens: int) -> str:
    """A user message whose conversation (chat template included) has about `tokens` tokens (the server's /tokenize)."""
    import httpx

    def count(text: str) -> int:
        body = {"model": "soak", "messages": [{"role": "user", "content": text}]}
        return httpx.post(serve.base_url[: -len("/v1")] + "/tokenize", json=body, timeout=60).json()["count"]

    words = tokens
    while count("river " * words) > tokens:
        words = words * 9 // 10
    return "river " * words


async def _kv_state(address: str) -> dict:
    """The core's counters once nothing runs (waiting up to 60 s for the aborted requests to leave)."""
    from headrace import AsyncEngine

    async with AsyncEngine.connect(address) as engine:
        deadline = time.monotonic() + 60
        while True:
            s = await engine.stats()
            idle = s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
            if idle or time.monotonic() > deadline:
                return {"idle": idle, "free_blocks": s.num_free_blocks, "blocks": s.num_blocks,
                        "running": s.num_running, "waiting": s.num_waiting}
            await asyncio.sleep(0.2)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def _client(base_url: str, rng: random.Random, long_prompt: list[int], long_chat: str, results: list, lock,
            stop) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=TIMEOUT)
    while not stop.is_set():
        kind = _draw(rng)
        t0 = time.monotonic()
        try:
            outcome = _one(client, kind, long_prompt, long_chat)
        except openai.APIStatusError as e:
            message = (e.body or {}).get("message") if isinstance(e.body, dict) else None
            outcome = "refused" if message else "bad"
            kind["status"], kind["message"] = str(e.status_code), (message or "")[:60]
            if kind["invalid"] and e.status_code != 400:
                outcome = "bad"
            retry = e.response.headers.get("retry-after")
            if retry:  # as a client should: wait before the next request
                time.sleep(min(float(retry), 2.0))
        except openai.APITimeoutError:
            outcome = "hung"
        except openai.APIConnectionError:
            outcome = "dropped"
        except openai.APIError as e:  # an error event in a stream (its core died, or the server stops)
            outcome, kind["status"], kind["message"] = ("refused" if e.message else "bad"), "in stream", e.message[:60]
        except Exception as e:  # a reply the client could not read, or a broken one
            outcome, kind["error"] = "bad", f"{type(e).__name__}: {e}"
        if kind["invalid"] and outcome not in ("refused", "bad"):
            outcome = "bad"  # an invalid body must be refused
        kind.update(outcome=outcome, began=t0, seconds=round(time.monotonic() - t0, 3))
        with lock:
            results.append(kind)


def _draw(rng: random.Random) -> dict:
    stream = rng.random() < 0.5
    return {"chat": rng.random() < 0.5, "stream": stream, "max_tokens": rng.randint(8, 64),
            "logprobs": rng.random() < 0.2, "n": 2 if rng.random() < 0.15 else 1, "stop": rng.random() < 0.15,
            "long": rng.random() < 0.1, "leave": stream and rng.random() < 0.1, "invalid": rng.random() < 0.01}


def _one(client: openai.OpenAI, k: dict, long_prompt: list[int], long_chat: str) -> str:
    """Send one request as k says; its outcome if it returned ("ok", "disconnected" or "bad")."""
    common = {"model": "soak", "max_tokens": k["max_tokens"], "n": k["n"], "temperature": -1.0 if k["invalid"] else 0.8,
              "stream": k["stream"], "stop": [" the"] if k["stop"] else None}
    if k["chat"]:
        text = long_chat if k["long"] else "Tell me about rivers."
        messages = [{"role": "user", "content": text}]
        extra = {"logprobs": True, "top_logprobs": 2} if k["logprobs"] else {}
        if k["long"]:  # the chat template's tokens too: leave room for them
            common["max_tokens"] = 8
        reply = client.chat.completions.create(messages=messages, **common, **extra)
    else:
        prompt = long_prompt if k["long"] else "The river flows"
        extra = {"logprobs": 2} if k["logprobs"] else {}
        reply = client.completions.create(prompt=prompt, **common, **extra)
    if not k["stream"]:
        return "ok" if _complete(reply.choices, reply.usage.completion_tokens, k, common["max_tokens"]) else "bad"
    finished, chunks = {}, 0
    for chunk in reply:
        chunks += 1
        if k["leave"] and chunks == 2:
            reply.close()
            return "disconnected"
        for c in chunk.choices:
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    ok = len(finished) == k["n"] and all(r in ("length", "stop") for r in finished.values())
    return "ok" if ok else "bad"


def _complete(choices, completion_tokens: int, k: dict, max_tokens: int) -> bool:
    if len(choices) != k["n"] or any(c.finish_reason not in ("length", "stop") for c in choices):
        return False
    if all(c.finish_reason == "length" for c in choices):
        return completion_tokens == max_tokens * k["n"]
    return True


def _check(report: dict) -> list[str]:
    outcomes = Counter(r["outcome"] for r in report["requests"])
    failures = []
    if outcomes["hung"] or report["hung_threads"]:
        failures.append(f"{outcomes['hung']} requests hung ({report['hung_threads']} client threads never ended)")
    if outcomes["bad"]:
        failures.append(f"{outcomes['bad']} requests ended bad")
    if not outcomes["ok"]:
        failures.append("no request succeeded")
    if not report["kv"]["idle"]:
        failures.append(f"the KV pool did not come back: {report['kv']}")
    grown = {k: v for k, v in report["rss_growth"].items() if v >= 0.05}
    if grown:
        failures.append(f"resident memory grew 5% or more after warm-up: {grown}")
    if report["rss_unchecked"]:
        failures.append(f"resident memory not compared (fewer than two samples from {report['rss_from']} s, after "
                        f"the load settled): {report['rss_unchecked']}")
    if report["serve_exit_code"] != 0:
        failures.append(f"headrace serve exited {report['serve_exit_code']} on SIGTERM")
    return failures


def _print(report: dict, failures: list[str]) -> None:
    reqs = report["requests"]
    print(f"soak: {report['minutes']:g} min (load for {report['load_s']:g} s), {report['clients']} clients, "
          f"{len(reqs)} requests; faults: "
          + ", ".join(f"{e['killed']} (pid {e['pid']}) at {e['at']}s" for e in report["events"]))
    outcomes = Counter(r["outcome"] for r in reqs)
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    refused = Counter((r["status"], r["message"]) for r in reqs if r["outcome"] == "refused")
    for (status, message), count in sorted(refused.items()):
        print(f"refused {count}: {status} {message!r}")
    ok = [r["seconds"] for r in reqs if r["outcome"] == "ok"]
    if ok:
        # inclusive: within the samples (the default extrapolates past the largest of a few dozen)
        q = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) > 1 else ok * 99
        print(f"ok request seconds: p50 {q[49]:.3f} p99 {q[98]:.3f} max {max(ok):.3f}")
    for r in [r for r in reqs if r["outcome"] == "bad"][:5]:
        print("bad:", r)
    print(f"KV after the load: {report['kv']}")
    print(f"VmRSS growth from {report['rss_from']:g} s to the end: "
          + ", ".join(f"{k} {v:+.1%}" for k, v in sorted(report["rss_growth"].items())))
    print("PASS" if not failures else "FAIL: " + "; ".join(failures), flush=True)


if __name__ == "__main__":
    sys.exit(main())
