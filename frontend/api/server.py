"""One API server process of `headrace serve` (frontend/api/supervise.py starts
and restarts them), and the listening sockets they share.

Every API server binds the port the parent holds, with SO_REUSEPORT, and
listens; the kernel spreads connections over them. Its AsyncEngine joins
every core with reconnect=True, so a core that the parent restarts is joined
again. Each API server also serves its frontend series on a private loopback
port and writes that URL into the run directory, where the parent writes the
cores' metrics URLs and its restart counts: /metrics on any of them shows
the cores' series, every frontend's and the restarts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
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


# ---- one API server process ----


def api_server_file(run_dir: Path, pid: int, suffix: str = ".url") -> Path:
    """An API server's file in the run directory: its frontend series' URL (.url), or the mark that its drain
    is done (.drained)."""
    return run_dir / f"frontend-{pid}{suffix}"


def _url_files(run_dir: Path) -> list[Path]:
    """The .url files of every API server in the run directory (frontend-PID.url)."""
    return sorted(run_dir.glob("frontend-*.url"))


class _Metrics:
    """/metrics: this frontend's registry, the cores' pages, the other API servers' pages and the
    parent's restart counts, merged."""

    def __init__(self, registry, run_dir: Path, own_file: Path, model_name: str) -> None:
        self.registry, self.run_dir, self.own_file, self.model_name = registry, run_dir, own_file, model_name

    async def __call__(self) -> bytes:
        from prometheus_client import generate_latest

        from headrace.metrics.exporter import merge_expositions

        urls = [f.read_text() for f in sorted(self.run_dir.glob("core-*.url"))]
        urls += [f.read_text() for f in _url_files(self.run_dir) if f != self.own_file]
        pages = await asyncio.gather(*(asyncio.to_thread(_fetch, u) for u in urls), return_exceptions=True)
        texts = [generate_latest(self.registry).decode(), self._restarts()]
        return merge_expositions(texts + [p for p in pages if isinstance(p, str)])

    def _restarts(self) -> str:
        from headrace.metrics.names import SERVE_RESTARTS as M

        try:
            counts = json.loads((self.run_dir / "restarts.json").read_text())
        except FileNotFoundError:  # not started by `headrace serve`
            return ""
        model = json.dumps(self.model_name)  # a quoted, escaped label value
        lines = [f"# HELP {M.name} {M.help}", f"# TYPE {M.name} counter"]
        lines += [f'{M.name}{{model_name={model},process="{kind}"}} {n}' for kind, n in sorted(counts.items())]
        return "\n".join(lines) + "\n"


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


async def _run_api_server(args: argparse.Namespace) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from headrace.frontend.api.app import OpenAIServer
    from headrace.frontend.async_engine import AsyncEngine
    from headrace.lifetime import freeze_heap
    from headrace.metrics.exporter import MetricsServer

    registry = CollectorRegistry()
    engine = AsyncEngine.connect(args.core, metrics_registry=registry, reconnect=True)
    await engine.start()
    peers = MetricsServer(registry, "127.0.0.1", 0)  # for the other API servers' /metrics
    run_dir = Path(args.run_dir)
    own = api_server_file(run_dir, os.getpid())
    part = own.with_suffix(".part")
    part.write_text(peers.url)
    part.rename(own)
    app = OpenAIServer(engine, args.served_model_name, metrics=_Metrics(registry, run_dir, own, engine.info.model),
                       api_key=envs.api_key())
    sock = listening_socket(args.host, args.port, listen=True)
    freeze_heap()  # this process serves until it exits: full collections skip the modules and the tokenizer
    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive)
    server = uvicorn.Server(config)
    # Until it serves, a signal just ends the process; the engine below still says goodbye to the core.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        # Serving, the first SIGTERM or SIGINT drains (app.drain), a second cuts the drain short;
        # then uvicorn closes the connections and returns.
        loop, now, draining = asyncio.get_running_loop(), asyncio.Event(), []

        async def drain() -> None:
            deadline = time.monotonic() + args.shutdown_timeout
            cut = await app.drain(args.shutdown_timeout, now)
            if cut:
                logging.getLogger("headrace.frontend").warning("shut down with %d requests unfinished", cut)
            await _wait_for_peers(own, deadline, now)
            server.should_exit = True

        def on_signal() -> None:
            if draining:
                now.set()
            else:
                draining.append(loop.create_task(drain()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        print("ready", flush=True)
    try:
        await task
    finally:
        own.unlink(missing_ok=True)
        own.with_suffix(".drained").unlink(missing_ok=True)
        peers.close()
        await engine.aclose()
        sock.close()


async def _wait_for_peers(own: Path, deadline: float, now: asyncio.Event) -> None:
    """Mark this API server's drain done (a .drained file beside its .url) and wait until every live API
    server's is, or until deadline (monotonic) or `now`. An API server that closed its socket while the others
    still drain would reset the connections the kernel had queued on it (SO_REUSEPORT spreads them) instead of
    answering them 503 as the others do."""
    own.with_suffix(".drained").touch()
    while not now.is_set() and time.monotonic() < deadline:
        if all(f.with_suffix(".drained").exists() or not _alive(f) for f in _url_files(own.parent)):
            return
        await asyncio.sleep(0.05)


def _alive(url_file: Path) -> bool:
    """Whether the API server that wrote url_file (frontend-PID.url) is running."""
    try:
        os.kill(int(url_file.stem.removeprefix("frontend-")), 0)
    except (ValueError, OSError):  # gone, or the pid is another user's process now
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    from headrace.frontend.async_engine import run
    from headrace.lifetime import die_with_parent

    parser = argparse.ArgumentParser(description="one API server process of `headrace serve`")
    parser.add_argument("--core", action="append", required=True)  # once per data-parallel core
    for flag in ("--host", "--run-dir", "--served-model-name"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--timeout-keep-alive", type=float, default=30.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent(args.parent_pid)
    run(_run_api_server(args))


if __name__ == "__main__":
    main()
