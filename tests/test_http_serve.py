"""`headrace serve` as processes: clients that disconnect, several API
servers on one port, the API key, and children that die and are restarted."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import openai
import pytest

from tests.cores import assert_core_idle
from tests.servers import Serve, wait_for

# Close to a thousand engine steps: far longer than the clients below wait.
LONG = {"max_tokens": 960, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Serve(checkpoint("qwen3"), "--api-servers", "2", "--served-model-name", "tiny", "--max-model-len", "1024")
    yield s
    assert s.stop() == 0
    assert not s.children()


def core_idle(server: Serve) -> None:
    assert_core_idle(server.core_address)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted = server.metric("headrace:request_success_total", finished_reason="abort")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.base_url + "/completions",
                         json={"model": "tiny", "prompt": "The river", "stream": True, **LONG}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection
    wait_for(lambda: server.metric("headrace:request_success_total", finished_reason="abort") == aborted + 1,
             what="the stream's abort")
    core_idle(server)


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    aborted = server.metric("headrace:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", timeout=0.3,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story"}], "n": 2,
                         **LONG})
    wait_for(lambda: server.metric("headrace:request_success_total", finished_reason="abort") == aborted + 1,
             what="the request's abort")
    core_idle(server)


def test_two_api_servers_share_the_port_and_the_metrics(server):
    """24 connections spread over both API servers; /metrics on either shows both frontends and the core."""
    def finished_by_frontend() -> dict[str, float]:
        _, page = server.get("/metrics")
        out = {}
        for m in re.finditer(r'headrace:request_success_total\{([^}]*)\} (\S+)', page.decode()):
            frontend = re.search(r'frontend="(\w+)"', m.group(1)).group(1)
            out[frontend] = out.get(frontend, 0.0) + float(m.group(2))
        return out

    before = finished_by_frontend()

    def one(i: int) -> None:
        with httpx.Client(timeout=60) as http:  # a connection of its own
            r = http.post(server.base_url + "/completions", json={"model": "tiny", "prompt": f"river {i}",
                                                                  "max_tokens": 4})
            assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = finished_by_frontend()
    grew = {f for f in after if after[f] > before.get(f, 0.0)}
    assert len(grew) == 2, after
    assert sum(after.values()) - sum(before.values()) == 24
    assert server.metric("headrace:generation_tokens_total") >= 24 * 4  # the core's series are there too
    _, page = server.get("/metrics")
    types = [line for line in page.decode().splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one family per name, holding both frontends'
    assert "# TYPE headrace:time_to_first_token_seconds histogram" in types


def test_a_second_server_on_the_port_is_refused(server, checkpoint):
    port = server.base_url.rsplit(":", 1)[1].split("/")[0]
    r = subprocess.run([sys.executable, "-m", "headrace.frontend.cli", "serve", "--model", str(checkpoint("qwen3")),
                        "--port", port], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "in use" in r.stderr


@pytest.mark.parametrize("flags,message", [(["--port", "70000"], "--port must be in [0, 65535]"),
                                           (["--port", "0", "--api-servers", "0"], "--api-servers must be >= 1"),
                                           (["--port", "0", "--data-parallel-size", "0"],
                                            "--data-parallel-size must be >= 1"),
                                           (["--port", "0", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
                                           (["--port", "0", "--restart-window", "0"], "--restart-window must be > 0"),
                                           (["--port", "0", "--shutdown-timeout", "-1"],
                                            "--shutdown-timeout must be >= 0"),
                                           (["--port", "0", "--timeout-keep-alive", "0"],
                                            "--timeout-keep-alive must be > 0")])
def test_bad_serve_flags_are_refused(checkpoint, flags, message):
    r = subprocess.run([sys.executable, "-m", "headrace.frontend.cli", "serve", "--model", str(checkpoint("qwen3")),
                        *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr


def test_api_key_is_required_on_v1_and_idle_connections_close_at_the_keep_alive_timeout(checkpoint):
    s = Serve(checkpoint("qwen3"), "--timeout-keep-alive", "1.5", env={"HEADRACE_API_KEY": "sekret"})
    try:
        # One connection: reused after 0.3 s idle, closed by the server after 1.5 s idle.
        conn = http.client.HTTPConnection(urllib.parse.urlsplit(s.root).netloc, timeout=5)
        try:
            for idle in (0.0, 0.3):
                time.sleep(idle)
                conn.request("GET", "/health")
                r = conn.getresponse()
                assert r.status == 200 and not r.will_close
                r.read()
            sock = conn.sock
            time.sleep(2.5)
            assert sock.recv(1) == b""  # the server closed it
        finally:
            conn.close()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=s.base_url, api_key="sekret", max_retries=0)
        model = c.models.list().data[0].id
        assert c.completions.create(model=model, prompt="Hi", max_tokens=3).usage.completion_tokens >= 1
        assert s.get("/health")[0] == 200 and s.get("/metrics")[0] == 200
    finally:
        assert s.stop() == 0


def _roles(s: Serve) -> dict[str, list[int]]:
    """serve's children by role: "core" and "api"."""
    out = {"core": [], "api": []}
    for pid in s.children():
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                out["core" if " core " in f.read().replace("\0", " ") else "api"].append(pid)
        except FileNotFoundError:  # gone since pgrep listed it
            pass
    return out


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid)


def test_a_dead_core_fails_its_requests_at_once_then_comes_back(checkpoint):
    s = Serve(checkpoint("qwen3"), "--max-model-len", "1024")
    try:
        core = _roles(s)["core"][0]
        whole = {}

        def wait_whole() -> None:
            r = httpx.post(s.base_url + "/completions", timeout=60, json={"prompt": "The river", **LONG})
            whole.update(status=r.status_code, body=r.json(), at=time.monotonic())

        t = threading.Thread(target=wait_whole)
        t.start()
        with httpx.stream("POST", s.base_url + "/completions", timeout=60,
                          json={"prompt": "The sea", "stream": True, **LONG}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            wait_for(lambda: s.metric("headrace:num_requests_running") == 2, what="both requests in the core")
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            error = next(line for line in lines if '"error"' in line)
            stream_failed = time.monotonic() - killed
        t.join(30)
        assert stream_failed < 0.5, stream_failed  # the API server watches the core's process exit
        assert "exited" in error
        assert whole["status"] == 503 and "exited" in whole["body"]["error"]["message"], whole
        assert whole["at"] - killed < 0.5
        # until the new core is ready: 503 with Retry-After, and /health says why
        r = httpx.post(s.base_url + "/completions", timeout=10, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] and "restarting" in r.json()["error"]["message"]
        h = httpx.get(s.root + "/health", timeout=10)
        assert h.status_code == 503 and b"restarting" in h.content and h.headers["retry-after"]
        wait_for(lambda: httpx.get(s.root + "/health", timeout=10).status_code == 200, timeout=60,
                 what="the restarted core")
        r = httpx.post(s.base_url + "/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert s.metric("headrace:serve_restarts_total", process="core") == 1
        assert s.metric("headrace:serve_restarts_total", process="api_server") == 0
        assert _gone(core) and len(_roles(s)["core"]) == 1
    finally:
        assert s.stop() == 0
    assert not s.children()


def test_a_dead_api_server_is_restarted_and_the_others_streams_go_on(checkpoint):
    s = Serve(checkpoint("qwen3"), "--api-servers", "2", "--max-model-len", "1024")
    try:
        victim = _roles(s)["api"][0]
        outcomes = []
        # SO_REUSEPORT hashes each connection to a server: with 8 streams all landed on the victim once in a
        # while (1 in 256); with 16, 1 in 65,536.
        streams = 16
        started = threading.Barrier(streams + 1)

        def stream(i: int) -> None:
            body = {"prompt": f"river {i}", "stream": True, "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            events, done, tokens = 0, False, None
            try:
                with httpx.Client(timeout=60) as http, http.stream("POST", s.base_url + "/completions",
                                                                    json=body) as r:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            events += 1
                            if events == 1:
                                started.wait()
                            tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
            except httpx.TransportError:  # its API server was killed
                outcomes.append("dropped")
                return
            outcomes.append("done" if done and tokens == 150 else f"cut after {events} events, {tokens} tokens")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        started.wait(30)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: len(_roles(s)["api"]) == 2 and victim not in _roles(s)["api"], timeout=3,
                 what="a new API server")
        assert time.monotonic() - killed < 3
        for t in threads:
            t.join(60)
        # the other API server's streams finish whole; the killed one's are dropped, never cut short quietly
        assert "done" in outcomes and set(outcomes) <= {"done", "dropped"}, outcomes
        wait_for(lambda: s.metric("headrace:serve_restarts_total", process="api_server") == 1, timeout=30,
                 what="the restart on /metrics")
        core_idle(s)  # the dropped streams were aborted in the core
        r = httpx.post(s.base_url + "/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
        # the run directory names the live API servers only (a drain waits for each one it names)
        api = _roles(s)["api"]
        with open(f"/proc/{api[0]}/cmdline") as f:
            argv = f.read().split("\0")
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        wait_for(lambda: sorted(int(f.stem.removeprefix("frontend-")) for f in run_dir.glob("frontend-*.url"))
                 == sorted(api), timeout=10, what="the run directory's API servers")
    finally:
        assert s.stop() == 0
    assert not s.children()


def _stream(url: str, body: dict, out: dict) -> None:
    """POST a stream; out gets its "events", whether it reached [DONE], its completion "tokens" and any "error"."""
    out.update(events=0, done=False, tokens=None, error=None)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/completions", json=body) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                out["events"] += 1
                out["error"] = event.get("error", out["error"])
                out["tokens"] = (event.get("usage") or {}).get("completion_tokens", out["tokens"])


def test_sigterm_lets_open_streams_finish_and_refuses_new_requests(checkpoint):
    """Two API servers, one stream: on SIGTERM both answer new requests with 503 until the stream has
    finished. The one with nothing to drain keeps its socket until the other is done, so no connection the
    kernel queued on it (SO_REUSEPORT) is dropped; then serve exits 0."""
    s = Serve(checkpoint("qwen3"), "--api-servers", "2", "--max-model-len", "1024")
    api = _roles(s)["api"]
    assert len(api) == 2
    out = {}
    t = threading.Thread(target=_stream, args=(s.base_url, {"prompt": "The river", **LONG}, out))
    t.start()
    wait_for(lambda: out.get("events"), what="the stream's first event")
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(s.root + "/health", timeout=10).status_code == 503, what="draining")
    time.sleep(0.5)  # long enough for a server with nothing to drain to have closed, were it to
    for _ in range(8):  # new connections, spread over both servers
        r = httpx.post(s.base_url + "/completions", timeout=10, json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert not out["done"] and all(_running(pid) for pid in api), out
    t.join(60)
    assert out["done"] and out["tokens"] == LONG["max_tokens"] and out["error"] is None, out
    assert s.proc.wait(30) == 0
    assert not s.children()


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_shutdown_timeout_and_a_second_sigterm_cut_requests_with_a_clear_error(checkpoint):
    for second_signal in (False, True):
        timeout = "60" if second_signal else "1"
        s = Serve(checkpoint("qwen3"), "--shutdown-timeout", timeout, "--max-model-len", "1024")
        out, whole = {}, {}
        t = threading.Thread(target=_stream, args=(s.base_url, {"prompt": "The river", **LONG}, out))
        t.start()

        def wait_whole() -> None:
            r = httpx.post(s.base_url + "/completions", timeout=60, json={"prompt": "The sea", **LONG})
            whole.update(status=r.status_code, body=r.json())

        w = threading.Thread(target=wait_whole)
        w.start()
        wait_for(lambda: out.get("events"), what="the stream's first event")
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        if second_signal:
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
        t.join(30)
        w.join(30)
        assert time.monotonic() - t0 < 5
        assert out["done"] and "shutting down" in out["error"]["message"], out
        assert ("second signal" if second_signal else "shutdown timeout (1s)") in out["error"]["message"]
        assert whole["status"] == 503 and "shutting down" in whole["body"]["error"]["message"], whole
        assert s.proc.wait(30) == 0
        assert not s.children()


def test_with_data_parallel_cores_the_others_serve_while_one_restarts(checkpoint):
    s = Serve(checkpoint("qwen3"), "--data-parallel-size", "2", "--max-model-len", "1024")
    try:
        first = sorted(_roles(s)["core"])
        os.kill(first[0], signal.SIGKILL)
        time.sleep(0.2)  # the API server sees the exit at once
        for i in range(4):
            r = httpx.post(s.base_url + "/completions", timeout=30, json={"prompt": f"Hi {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        h = httpx.get(s.root + "/health", timeout=10)
        assert h.status_code == 200
        wait_for(lambda: len(_roles(s)["core"]) == 2 and first[0] not in _roles(s)["core"], timeout=60,
                 what="the restarted core")
        wait_for(lambda: httpx.get(s.root + "/health", timeout=10).content == b"", timeout=60,
                 what="both cores serving")
        assert s.metric("headrace:serve_restarts_total", process="core") == 1
    finally:
        assert s.stop() == 0
    assert not s.children()


def test_restarts_past_the_budget_stop_serve(checkpoint):
    s = Serve(checkpoint("qwen3"), "--max-restarts", "1", "--restart-window", "600")
    core = _roles(s)["core"][0]
    os.kill(core, signal.SIGKILL)
    wait_for(lambda: httpx.get(s.root + "/health", timeout=10).status_code == 200 and _roles(s)["core"]
             and _roles(s)["core"][0] != core, timeout=60, what="the restarted core")
    children = s.children()
    os.kill(_roles(s)["core"][0], signal.SIGKILL)
    assert s.proc.wait(30) == 1  # a second restart would exceed --max-restarts 1
    for pid in children:
        wait_for(lambda: _gone(pid), what=f"process {pid} to end")


def test_no_restart_stops_serve_when_the_core_dies(checkpoint):
    s = Serve(checkpoint("qwen3"), "--no-restart")
    children = s.children()
    os.kill(_roles(s)["core"][0], signal.SIGKILL)
    assert s.proc.wait(30) == 1
    for pid in children:
        wait_for(lambda: _gone(pid), what=f"process {pid} to end")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except FileNotFoundError:
        return "zombie"
