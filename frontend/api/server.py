"""`headrace serve`: one engine-core process and N HTTP API server processes.

    headrace serve (this module's serve(), the parent)
      |-- headrace core 1..D     the engine (D with --data-parallel-size), each on a private ipc
                                 socket; metrics on a loopback port
      |-- API server 1..N        python -m headrace.frontend.api.server: uvicorn + an AsyncEngine
                                 frontend connected to every core's socket

The parent binds the listening port with SO_REUSEPORT (learning the port
when --port is 0) and keeps it bound; every API server binds the same port
the same way and listens, and the kernel spreads connections over them. Each
API server also serves its frontend series on a private loopback port and
writes that URL into the run directory, so that /metrics on any of them
shows the core's series and every frontend's. The parent exits when any
child does (stopping the others), and on SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from headrace import envs


def listening_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket on (host, port) with SO_REUSEPORT, so that several
    processes can bind and accept on one port."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("headrace serve needs SO_REUSEPORT (Linux or a BSD)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket on (host, port) holding the
    port for the API servers. The port is first bound without SO_REUSEPORT,
    so a port another server holds, headrace's included, is refused instead
    of shared with it."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, never past a listener
            probe.bind((host, port))
            port = probe.getsockname()[1]
        return listening_socket(host, port, listen=False)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


# ---- the parent ----


def serve(args: argparse.Namespace, engine_args) -> int:
    """Run `headrace serve` until a signal or a child's exit; returns the exit code."""
    from headrace.frontend.core_process import CoreProcess

    if args.api_servers < 1:
        raise ValueError(f"--api-servers must be >= 1, got {args.api_servers}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    reserved = reserve_port(args.host, args.port)
    port = reserved.getsockname()[1]
    run_dir = tempfile.mkdtemp(prefix="headrace-serve-")  # mode 0700: the frontends' metrics URLs
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # start-up (loading the model) is interrupted at once
        signal.signal(sig, _interrupt)
    cores: list[CoreProcess] = []
    api: list[subprocess.Popen] = []
    code = 1
    try:
        print(f"headrace serve: loading {engine_args.model} in {args.data_parallel_size} engine core"
              f"{'s' if args.data_parallel_size > 1 else ''}...", file=sys.stderr, flush=True)
        for i in range(args.data_parallel_size):  # appended one by one: a failing spawn leaves the others stoppable
            cores.append(CoreProcess.spawn(engine_args, metrics_port=0, data_parallel_rank=i))
        core_flags = []
        for core in cores:
            core_flags += ["--core", core.address, "--core-metrics-url", core.metrics_url()]  # waits for the model
        env = dict(os.environ)
        if args.api_key:
            env["HEADRACE_API_KEY"] = args.api_key  # in the environment, not on a command line ps shows
        cmd = [sys.executable, "-m", "headrace.frontend.api.server", *core_flags,
               "--host", args.host, "--port", str(port), "--run-dir", run_dir,
               "--served-model-name", args.served_model_name or engine_args.model, "--parent-pid", str(os.getpid())]
        api = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(args.api_servers)]
        for p in api:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"an API server exited during start-up (exit code {p.wait()}); its log is above")
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"headrace serve: {engine_args.model} at http://{shown}:{port}/v1 "
              f"({args.api_servers} API server{'s' if args.api_servers > 1 else ''})", flush=True)
        for core in cores:
            print(f"headrace serve: engine core at {core.address} (AsyncEngine.connect joins it)", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.append(True))
        while not stopping:
            if not all(c.alive() for c in cores) or any(p.poll() is not None for p in api):
                which = "an engine core" if not all(c.alive() for c in cores) else "an API server"
                print(f"headrace serve: {which} exited; stopping", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
        code = 0 if stopping else 1
    except RuntimeError as e:
        print(f"headrace serve: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("headrace serve: interrupted during start-up", file=sys.stderr, flush=True)
    finally:
        for p in api:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in api:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for core in cores:
            core.shutdown()
        reserved.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


# ---- one API server process ----


class _Metrics:
    """/metrics: this frontend's registry, the core's page and the other API servers' pages, merged."""

    def __init__(self, registry, core_urls: list[str], run_dir: Path, own_file: Path) -> None:
        self.registry, self.core_urls, self.run_dir, self.own_file = registry, core_urls, run_dir, own_file

    async def __call__(self) -> bytes:
        from prometheus_client import generate_latest

        from headrace.metrics.exporter import merge_expositions

        urls = self.core_urls + [f.read_text() for f in sorted(self.run_dir.glob("frontend-*.url"))
                                  if f != self.own_file]
        pages = await asyncio.gather(*(asyncio.to_thread(_fetch, u) for u in urls), return_exceptions=True)
        texts = [generate_latest(self.registry).decode()] + [p for p in pages if isinstance(p, str)]
        return merge_expositions(texts)


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


async def _run_api_server(args: argparse.Namespace) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from headrace.frontend.api.app import OpenAIServer
    from headrace.frontend.async_engine import AsyncEngine
    from headrace.metrics.exporter import MetricsServer

    registry = CollectorRegistry()
    engine = AsyncEngine.connect(args.core, metrics_registry=registry)
    await engine.start()
    peers = MetricsServer(registry, "127.0.0.1", 0)  # for the other API servers' /metrics
    run_dir = Path(args.run_dir)
    own = run_dir / f"frontend-{os.getpid()}.url"
    part = own.with_suffix(".part")
    part.write_text(peers.url)
    part.rename(own)
    app = OpenAIServer(engine, args.served_model_name, metrics=_Metrics(registry, args.core_metrics_url, run_dir, own),
                       api_key=envs.api_key())
    sock = listening_socket(args.host, args.port, listen=True)
    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT while it serves, then raises the signal
    # again under the handler it found: let that one return, so the engine
    # below says goodbye to the core.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        print("ready", flush=True)
    try:
        await task
    finally:
        own.unlink(missing_ok=True)
        peers.close()
        await engine.aclose()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    import logging

    from headrace.frontend.async_engine import run
    from headrace.lifetime import die_with_parent

    parser = argparse.ArgumentParser(description="one API server process of `headrace serve`")
    for flag in ("--core", "--core-metrics-url"):  # once per data-parallel core
        parser.add_argument(flag, action="append", required=True)
    for flag in ("--host", "--run-dir", "--served-model-name"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent(args.parent_pid)
    run(_run_api_server(args))


if __name__ == "__main__":
    main()
