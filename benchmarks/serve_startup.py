"""Start-up time and memory of `headrace serve`'s HTTP API server processes.

    python benchmarks/serve_startup.py [--model PATH] [--repeats 5] [--api-servers 1,4] [--parts 1,2]
    PYTHONPATH=/tmp/pkg python benchmarks/serve_startup.py   # measures /tmp/pkg/headrace instead

Processes run as `sys.executable -m headrace...` with this environment in a
private temporary directory: the tree measured is the headrace found there
(PYTHONPATH first), printed with its commit. Model: SmolLM2-135M-Instruct Q4_1.

Part 1: one `headrace core --metrics-port 0` on a private ipc socket (spawn to
its "metrics at" line, i.e. the model loaded, is shown), then API server
processes (python -m headrace.frontend.api.server) against it one at a time,
on a loopback port held bound here with SO_REUSEPORT as `headrace serve` does:
spawn to its "ready" line and to the first GET /health 200 (polled every 10
ms); VmRSS and VmHWM (/proc/PID/status) then and after 4 sequential
/v1/completions of 8 tokens; libtorch in /proc/PID/maps or not. SIGTERM, wait.

Part 2, `headrace serve --api-servers N --port 0` for each N: spawn to the
first /health 200 (the port read from the --port flag of its first API server
child) and to its "at http://" line, printed once all N are ready; the VmRSS
of each API server child (told from the core by its command line), their sum
and the core's. SIGTERM the parent; wait until its process group is gone.

Figures: median, min and max of --repeats runs after --warmup untimed ones
(per part and N): the first API server started for a model converts its GGUF
tokenizer into ~/.cache/headrace (seconds, ~130 MiB more RSS). Children run in
their own process groups with stderr in a log file (its tail is printed when
one fails), and are stopped on exit, Ctrl-C and SIGTERM.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.metadata
import json
import os
import platform
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

API_SERVER = "headrace.frontend.api.server"
HEADRACE = [sys.executable, "-m", "headrace.frontend.cli"]
NAME = "bench"  # --served-model-name of part 1's API servers


def live(match) -> list[int]:
    """Pids of the processes, zombies left out, whose (ppid, process group) from /proc/PID/stat match."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            state, ppid, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # not a process, or exited meanwhile
            continue
        if state != "Z" and match(int(ppid), int(pgrp)):
            out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def memory(pid: int) -> dict:
    """VmRSS and VmHWM in MiB, and torch: whether libtorch is mapped."""
    lines = (line.split(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    out = {k: int(v.split()[0]) / 1024 for k, v in lines if k in ("VmRSS", "VmHWM")}
    return out | {"torch": "libtorch" in Path(f"/proc/{pid}/maps").read_text()}


def request(port: int, method: str, path: str, body=None, timeout: float = 120) -> int:
    """The HTTP status of one request to 127.0.0.1:port, sent without proxies."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("HEADRACE_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["HEADRACE_API_KEY"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class Child:
    """A child process in its own process group; its stdout lines are queued with their time since spawn."""

    def __init__(self, cmd: list[str], tmp: Path, log: str, children: list[Child]) -> None:
        self.log, self.lines = tmp / log, queue.Queue()
        with open(self.log, "ab") as err:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         text=True, cwd=tmp, start_new_session=True)
        self.pid = self.proc.pid
        children.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter() - self.t0, line.rstrip("\n")))

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(self.proc.args[2:4])} exited ({self.proc.returncode}); {self.log}:\n{tail}")

    def line(self, pattern: str, timeout: float) -> tuple[float, str]:
        """(seconds since spawn, line) of the first stdout line matching pattern."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, line = self.lines.get(timeout=0.1)
            except queue.Empty:
                self.check()
                continue
            if re.search(pattern, line):
                return t, line
        raise RuntimeError(f"no line matching {pattern!r} from {' '.join(self.proc.args[2:4])} in {timeout} s")

    def health(self, port_of, timeout: float) -> float:
        """Seconds since spawn of the first GET /health 200, polled every 10 ms once port_of() gives the port."""
        deadline, port = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            self.check()
            port = port or port_of()
            try:
                if port and request(port, "GET", "/health", timeout=1) == 200:
                    return time.perf_counter() - self.t0
            except (OSError, http.client.HTTPException):  # not listening yet
                pass
            time.sleep(0.01)
        raise RuntimeError(f"/health did not answer 200 in {timeout} s")

    def stop(self, children: list[Child], timeout: float = 30.0) -> None:
        """SIGTERM; wait until it and every live process of its group exit; then SIGKILL the group if need be."""
        self.proc.terminate()
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None or live(lambda ppid, pgrp: pgrp == self.pid):
            if time.monotonic() > deadline:
                print(f"killing process group {self.pid} ({' '.join(self.proc.args[2:4])})", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()
                break
            time.sleep(0.05)
        children.remove(self)


def one_api_server(args, tmp: Path, children: list[Child]) -> None:
    address = f"ipc://{tmp}/core.sock"
    core = Child([*HEADRACE, "core", "--model", args.model, "--address", address, "--metrics-port", "0",
                  "--device", args.device, "--parent-pid", str(os.getpid())], tmp, "core.log", children)
    t_core, line = core.line("^headrace core: metrics at ", args.timeout)
    runs = []
    for i in range(args.warmup + args.repeats):
        run_dir = tmp / f"run{i}"
        run_dir.mkdir()
        with socket.socket() as hold:  # holds the port; a bound socket that never listens gets no connections
            hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            hold.bind(("127.0.0.1", 0))
            port = hold.getsockname()[1]
            (run_dir / "core-0.url").write_text(line.split(" at ", 1)[1])  # where the API server finds it
            api = Child([sys.executable, "-m", API_SERVER, "--core", address, "--host", "127.0.0.1", "--port",
                         str(port), "--run-dir",
                         str(run_dir), "--served-model-name", NAME, "--parent-pid", str(os.getpid())], tmp,
                        "api.log", children)
            try:
                t_health = api.health(lambda: port, args.timeout)
                t_ready = api.line("^ready$", args.timeout)[0]
                at_health = memory(api.pid)
                for _ in range(4):
                    body = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8}
                    if (status := request(port, "POST", "/v1/completions", body)) != 200:
                        raise RuntimeError(f"/v1/completions answered {status}")
                runs.append((t_ready, t_health, at_health, memory(api.pid)))
            finally:
                api.stop(children)
    runs = runs[args.warmup:]
    table(f"Part 1: one API server process, {len(runs)} runs (the core: {t_core:.2f} s from spawn to its "
          f"metrics line, VmRSS {memory(core.pid)['VmRSS']:.0f} MiB)", [
        ("spawn to 'ready' (s)", [r[0] for r in runs], ".3f"),
        ("spawn to /health 200 (s)", [r[1] for r in runs], ".3f"),
        ("VmRSS at /health (MiB)", [r[2]["VmRSS"] for r in runs], ".0f"),
        ("VmHWM at /health (MiB)", [r[2]["VmHWM"] for r in runs], ".0f"),
        ("VmRSS after 4 completions (MiB)", [r[3]["VmRSS"] for r in runs], ".0f"),
        ("VmHWM after 4 completions (MiB)", [r[3]["VmHWM"] for r in runs], ".0f")])
    print(f"libtorch mapped in the API server: {sum(r[2]['torch'] for r in runs)}/{len(runs)} runs at /health, "
          f"{sum(r[3]['torch'] for r in runs)}/{len(runs)} after the completions", flush=True)
    core.stop(children)


def serve(args, tmp: Path, children: list[Child], n: int) -> None:
    def api_servers(parent: int) -> list[int]:
        return [pid for pid in live(lambda ppid, pgrp: ppid == parent) if API_SERVER in cmdline(pid)]

    def first_port(parent: int) -> int | None:
        found = [re.search(r"--port (\d+)", cmdline(pid)) for pid in api_servers(parent)]
        return int(found[0].group(1)) if found and found[0] else None

    runs = []
    for _ in range(args.warmup + args.repeats):
        parent = Child([*HEADRACE, "serve", "--model", args.model, "--api-servers", str(n), "--port", "0",
                        "--device", args.device], tmp, f"serve{n}.log", children)
        try:
            t_health = parent.health(lambda: first_port(parent.pid), args.timeout)
            t_line = parent.line(r" at http://\S+:\d+/v1", args.timeout)[0]
            apis = api_servers(parent.pid)
            others = [pid for pid in live(lambda ppid, pgrp: ppid == parent.pid) if pid not in apis]
            if len(apis) != n:
                raise RuntimeError(f"expected {n} API server children of {parent.pid}, found {apis}")
            runs.append((t_health, t_line, [memory(pid) for pid in apis], sum(memory(pid)["VmRSS"] for pid in others)))
        finally:
            parent.stop(children)
    runs = runs[args.warmup:]
    table(f"Part 2: headrace serve --api-servers {n}, {len(runs)} runs", [
        ("spawn to first /health 200 (s)", [r[0] for r in runs], ".2f"),
        ("spawn to the 'at http://' line (s)", [r[1] for r in runs], ".2f"),
        ("API servers' VmRSS, sum (MiB)", [sum(m["VmRSS"] for m in r[2]) for r in runs], ".0f"),
        ("API server VmRSS, each (MiB)", [m["VmRSS"] for r in runs for m in r[2]], ".0f"),
        ("engine core VmRSS (MiB)", [r[3] for r in runs], ".0f")])
    print(f"libtorch mapped in {sum(m['torch'] for r in runs for m in r[2])}/{n * len(runs)} API server processes",
          flush=True)


def table(title: str, rows: list[tuple[str, list[float], str]]) -> None:
    print(f"\n{title}\n\n| | median | min | max |\n|---|---:|---:|---:|")
    for label, values, spec in rows:
        print(f"| {label} | {statistics.median(values):{spec}} | {min(values):{spec}} | {max(values):{spec}} |")


def facts(tmp: Path) -> None:
    """The tree the children import (found as they find it), its commit, and the machine."""
    find = "import importlib.util; print(importlib.util.find_spec('headrace').origin)"
    origin = subprocess.run([sys.executable, "-c", find], cwd=tmp, capture_output=True, text=True, check=True)
    tree = Path(origin.stdout.strip()).resolve().parent

    def git(*flags: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *flags], capture_output=True, text=True).stdout.strip()

    print(f"headrace: {tree} at {git('rev-parse', '--short', 'HEAD') or '?'} "
          f"({'dirty' if git('status', '--porcelain') else 'clean'})")
    print(f"python {platform.python_version()} ({sys.executable}); torch {importlib.metadata.version('torch')}; "
          f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; PYTHONDONTWRITEBYTECODE="
          f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the SmolLM2-135M-Instruct Q4_1 GGUF, fetched once)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each part's and each N's")
    parser.add_argument("--api-servers", default="1,4", help="comma-separated N for part 2")
    parser.add_argument("--parts", default="1,2", help="comma-separated parts to run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=600, help="seconds any one start-up may take")
    args = parser.parse_args()
    if args.model is None:
        try:
            from headrace.checkpoint.smollm2 import smollm2_gguf
        except ImportError:
            from headrace.testing.smollm2 import smollm2_gguf
        args.model = str(smollm2_gguf(progress=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below
    tmp, children = Path(tempfile.mkdtemp(prefix="serve-startup-")), []
    try:
        facts(tmp)
        print(f"model {args.model} on {args.device}; logs in {tmp}", flush=True)
        if "1" in args.parts.split(","):
            one_api_server(args, tmp, children)
        for n in map(int, args.api_servers.split(",")) if "2" in args.parts.split(",") else []:
            serve(args, tmp, children, n)
        print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        shutil.rmtree(tmp, ignore_errors=True)  # kept, with the logs, when something failed
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
        for child in reversed(children[:]):
            child.stop(children)


if __name__ == "__main__":
    main()
