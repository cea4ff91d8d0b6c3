"""`headrace serve`'s parent: starts the engine cores and the API servers, and keeps them running.

    headrace serve (serve(), the parent)
      |-- headrace core 1..D     the engine (D with --data-parallel-size), each on a private ipc
                                 socket; metrics on a loopback port
      |-- API server 1..N        python -m headrace.frontend.api.server: uvicorn + an AsyncEngine
                                 frontend connected (reconnect=True) to every core's socket

The parent binds the listening port with SO_REUSEPORT (learning the port when
--port is 0) and keeps it bound, so the port stays taken while children come
and go. Each child is watched for its exit:
- a dead API server is started again with the same command. Its requests die
  with it (the core sees the process exit and aborts them); the other API
  servers' requests go on.
- a dead core is started again with the same arguments at the same address.
  The API servers see its exit at once and fail its requests with 503s naming
  the cause, answer new ones with 503 and Retry-After (and /health with
  "restarting") until the new core is ready, then serve again.
Restarts are counted on /metrics (headrace:serve_restarts_total, by process).
More than --max-restarts within --restart-window seconds, counting every
child, and serve stops everything and exits 1; --no-restart stops at the
first exit.

SIGTERM or SIGINT drains: the API servers answer new requests (and /health)
with 503 and let the running ones finish, up to --shutdown-timeout seconds;
the requests still running then fail with a 503 that says so, as they do at
once on a second signal. Each keeps its socket until all are done (server.py's
_wait_for_peers). Then the cores stop and serve exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from headrace.frontend.api.server import api_server_file, reserve_port
from headrace.lifetime import terminate


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


class _Child:
    """One supervised process: spawn() makes it, and a thread of its own waits until it is ready.
    Processes are spawned from the main thread: a child's PR_SET_PDEATHSIG (lifetime.py) fires
    when the thread that spawned it ends."""

    def __init__(self, kind: str, name: str, spawn) -> None:
        self.kind, self.name = kind, name  # "core" or "api_server"; what the log calls it
        self._spawn = spawn  # () -> an object with wait_ready(), alive() and stop()
        self.process = None
        self.starting: threading.Thread | None = None
        self.failure: str | None = None  # why the last start failed

    def start(self) -> None:
        self.process, self.failure, self.starting = None, None, None
        try:
            self.process = self._spawn()
        except Exception as e:
            self.failure = str(e) or type(e).__name__
            return
        self.starting = threading.Thread(target=self._wait, name=f"start {self.name}", daemon=True)
        self.starting.start()

    def _wait(self) -> None:
        try:
            self.process.wait_ready()
        except Exception as e:
            self.failure = str(e) or type(e).__name__

    @property
    def down(self) -> bool:
        """Dead, or failed to start (a start still under way is neither)."""
        if self.starting is not None and self.starting.is_alive():
            return False
        return self.failure is not None or self.process is None or not self.process.alive()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()  # also ends a start still waiting for it
        if self.starting is not None:
            self.starting.join()


class _ApiServer:
    def __init__(self, cmd: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)

    def terminate(self) -> None:
        """SIGTERM: the first drains it, a second cuts the drain short."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_ready(self) -> None:
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"an API server exited during start-up (exit code {self.proc.wait()}); "
                               f"its log is above")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        terminate(self.proc, 15)


class _Core:
    def __init__(self, engine_args, address: str, rank: int, url_file: Path) -> None:
        from headrace.frontend.core_process import CoreProcess

        self.core = CoreProcess.spawn(engine_args, address, metrics_port=0, data_parallel_rank=rank)
        self.url_file = url_file

    def wait_ready(self) -> None:
        _write_whole(self.url_file, self.core.metrics_url())  # waits for the model; the API servers' /metrics read it

    def alive(self) -> bool:
        return self.core.alive()

    def stop(self) -> None:
        self.core.shutdown()


def check_flags(args: argparse.Namespace) -> None:
    if args.api_servers < 1:
        raise ValueError(f"--api-servers must be >= 1, got {args.api_servers}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.restart_window > 0:
        raise ValueError(f"--restart-window must be > 0 seconds, got {args.restart_window}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not 0 < args.timeout_keep_alive < math.inf:
        raise ValueError(f"--timeout-keep-alive must be > 0 seconds and finite, got {args.timeout_keep_alive}")


def serve(args: argparse.Namespace, engine_args) -> int:
    """Run `headrace serve` until a signal, or a child's exit it does not restart; returns the exit code."""
    from headrace.frontend.core_process import private_ipc_address, remove_private_ipc

    check_flags(args)
    reserved = reserve_port(args.host, args.port)
    port = reserved.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="headrace-serve-"))  # mode 0700: metrics URLs, restart counts
    for sig in (signal.SIGTERM, signal.SIGINT):  # start-up (loading the model) is interrupted at once
        signal.signal(sig, _interrupt)
    ipc = [private_ipc_address() for _ in range(args.data_parallel_size)]
    cores = [_Child("core", f"engine core {i}", lambda i=i: _Core(engine_args, ipc[i][0], i, run_dir / f"core-{i}.url"))
             for i in range(args.data_parallel_size)]
    env = dict(os.environ)
    if args.api_key:
        env["HEADRACE_API_KEY"] = args.api_key  # in the environment, not on a command line ps shows
    cmd = [sys.executable, "-m", "headrace.frontend.api.server", *[a for addr, _ in ipc for a in ("--core", addr)],
           "--host", args.host, "--port", str(port), "--run-dir", str(run_dir),
           "--shutdown-timeout", str(args.shutdown_timeout), "--timeout-keep-alive", str(args.timeout_keep_alive),
           "--served-model-name", args.served_model_name or engine_args.model, "--parent-pid", str(os.getpid())]
    api = [_Child("api_server", f"API server {i}", lambda: _ApiServer(cmd, env)) for i in range(args.api_servers)]
    signals: list[int] = []  # SIGTERM and SIGINT received once serving
    code = 1
    try:
        print(f"headrace serve: loading {engine_args.model} in {args.data_parallel_size} engine core"
              f"{'s' if args.data_parallel_size > 1 else ''}...", file=sys.stderr, flush=True)
        for group in (cores, api):  # the API servers' handshake waits for the cores
            for child in group:
                child.start()
            for child in group:
                if child.starting is not None:
                    child.starting.join()
                if child.failure is not None:
                    raise RuntimeError(child.failure)
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"headrace serve: {engine_args.model} at http://{shown}:{port}/v1 "
              f"({args.api_servers} API server{'s' if args.api_servers > 1 else ''})", flush=True)
        for address, _ in ipc:
            print(f"headrace serve: engine core at {address} (AsyncEngine.connect joins it)", flush=True)
        code = _supervise(cores + api, args, run_dir, signals)
    except RuntimeError as e:
        print(f"headrace serve: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("headrace serve: interrupted during start-up", file=sys.stderr, flush=True)
    finally:
        _record_signals(signals)  # from here a signal only shortens the drain
        _drain(api, args.shutdown_timeout, signals)
        for child in api + cores:  # the API servers first: they say goodbye to the cores
            child.stop()
        for address, directory in ipc:
            remove_private_ipc(address, directory)
        reserved.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _supervise(children: list[_Child], args: argparse.Namespace, run_dir: Path, signals: list[int]) -> int:
    """Restart what dies until a signal (0) or the restart budget runs out (1)."""
    _record_signals(signals)
    recent: deque[float] = deque()  # when each restart within the window began
    counts = {"core": 0, "api_server": 0}
    _write_counts(run_dir, counts)
    while not signals:
        for child in children:
            if not child.down:
                continue
            why = f" ({child.failure})" if child.failure else ""
            if args.no_restart:
                print(f"headrace serve: {child.name} exited{why}; stopping", file=sys.stderr, flush=True)
                return 1
            now = time.monotonic()
            while recent and recent[0] < now - args.restart_window:
                recent.popleft()
            if len(recent) >= args.max_restarts:
                print(f"headrace serve: {child.name} exited{why}, and {len(recent)} restarts in the last "
                      f"{args.restart_window:g}s reach --max-restarts; stopping", file=sys.stderr, flush=True)
                return 1
            recent.append(now)
            counts[child.kind] += 1
            _write_counts(run_dir, counts)
            print(f"headrace serve: {child.name} exited{why}; restarting it", file=sys.stderr, flush=True)
            if child.kind == "api_server" and child.process is not None:  # the files a killed one left
                for suffix in (".url", ".drained"):
                    api_server_file(run_dir, child.process.proc.pid, suffix).unlink(missing_ok=True)
            child.start()
        time.sleep(0.05)
    return 0


def _drain(api: list[_Child], timeout: float, signals: list[int]) -> None:
    """SIGTERM every API server, so each lets its running requests finish (up to timeout seconds),
    and wait for them; a second signal to serve is passed on, cutting their drain short."""
    servers = [c.process for c in api if c.process is not None and c.process.alive()]
    for server in servers:
        server.terminate()
    passed_on, deadline = False, time.monotonic() + timeout + 10  # two signals already: passed on at once
    while any(s.alive() for s in servers) and time.monotonic() < deadline:
        if len(signals) > 1 and not passed_on:
            passed_on = True
            for server in servers:
                server.terminate()
        time.sleep(0.05)


def _record_signals(signals: list[int]) -> None:
    """From now on SIGTERM and SIGINT are appended to signals."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: signals.append(num))


def _write_counts(run_dir: Path, counts: dict[str, int]) -> None:
    _write_whole(run_dir / "restarts.json", json.dumps(counts))


def _write_whole(path: Path, text: str) -> None:
    """Write path so that a reader sees the old file or the new one, never a part."""
    part = path.with_suffix(".part")
    part.write_text(text)
    part.rename(path)
