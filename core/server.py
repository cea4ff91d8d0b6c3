"""The engine-core server: sockets, the busy loop, and frontend liveness.

Threads:
- the I/O thread owns the ROUTER socket. It decodes frames, answers Hello
  with Ready, tracks when each frontend was last heard, sends heartbeats,
  queues everything else for the busy loop, and forwards the busy loop's
  encoded replies to their frontends. Frames that do not decode, or come
  from a peer that never said Hello, are logged and dropped.
- the busy loop (serve_forever) owns the EngineCore: it takes queued
  messages, then schedules, executes and sends one StepOutputs message per
  frontend per step. It never touches a socket but its own inproc PUSH.

Requests are keyed by (frontend, request id): frontends choose their ids
freely and can only abort their own.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid

import zmq

from headrace import envs
from headrace.checkpoint.paths import resolve_model_path
from headrace.checkpoint.tokenizer import prepare_tokenizer, read_prepared
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore
from headrace.core.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    CoreExit,
    GetStats,
    Goodbye,
    Heartbeat,
    Hello,
    Ping,
    Ready,
    RequestError,
    Stats,
    StepOutputs,
    encode,
    to_core_decoder,
    unpack_ids,
)
from headrace.lifetime import watch_exit

logger = logging.getLogger("headrace.core")
MAX_MESSAGE_BYTES = 256 * 2**20


class _Gone:
    """Queued by the I/O thread when a frontend said Goodbye or fell silent."""


def bind_router(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to address; returns it and the address actually bound
    (a tcp port 0 becomes the chosen port). ipc socket files are made
    owner-only."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if address.startswith("ipc://"):
        old = os.umask(0o077)
        try:
            sock.bind(address)
        finally:
            os.umask(old)
        os.chmod(address[len("ipc://"):], 0o600)
    else:
        sock.bind(address)
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class CoreServer:
    """metrics_port: serve the core's Prometheus series on metrics_host:port
    (0 = a free port; the bound one is self.metrics_port afterwards).
    data_parallel_rank: see EngineCore.

    The tokenizer is prepared here, once per checkpoint on this machine
    (checkpoint/tokenizer.py), and Ready carries the prepared files, which
    frontends load without torch (and without files of their own)."""

    def __init__(self, args: EngineArgs, address: str, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", data_parallel_rank: int = 0) -> None:
        self.engine = EngineCore(args, data_parallel_rank)
        try:  # what fails from here on must not leave the engine's memory or workers behind
            tokenizer_json, tokenizer_meta = read_prepared(
                prepare_tokenizer(resolve_model_path(args.tokenizer or args.model), envs.cache_dir()))
            self.engine.startup.lap("tokenizer")
            self.engine.tokenizer_source = (tokenizer_json, tokenizer_meta)  # beam search's stop strings
            self.engine_id = uuid.uuid4().hex[:12]
            self.model_name = self.engine.model_config.path
            self.metrics_server = None
            self.metrics_port: int | None = None
            self._ctx = zmq.Context()
            self._router, self.address = bind_router(self._ctx, address)
            self._out_address = f"inproc://headrace-out-{self.engine_id}"
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.bind(self._out_address)
            self._inbox: queue.Queue = queue.Queue()
            # A plain flag, not a threading.Event: stop() runs in signal handlers, and Event.set() takes a
            # lock that a second signal, arriving inside the first handler's set(), would wait on forever.
            self._stopping = False
            self._exit_reason = "the engine core is shutting down"  # what frontends are told when it stops
            self._io_thread: threading.Thread | None = None
            # internal request id -> (frontend identity, the frontend's request id)
            self._owners: dict[str, tuple[bytes, str]] = {}
            self._by_frontend: dict[bytes, set[str]] = {}  # identity -> internal request ids
            self._num_frontends = 0
            mc = self.engine.model_config
            self._ready = encode(Ready(
                protocol=PROTOCOL_VERSION,
                engine_id=self.engine_id,
                model=mc.path,
                tokenizer=args.tokenizer or mc.path,
                tokenizer_json=tokenizer_json,
                tokenizer_meta=tokenizer_meta,
                max_model_len=self.engine.sched_config.max_model_len,
                vocab_size=mc.vocab_size,
                eos_token_ids=sorted(mc.eos_token_ids),
                bos_token_id=mc.bos_token_id,
                block_size=self.engine.cache_config.block_size,
                num_kv_blocks=self.engine.cache_config.num_blocks,
                pid=os.getpid(),
            ))
            if metrics_port is not None:
                from prometheus_client import CollectorRegistry

                from headrace.metrics.exporter import MetricsServer

                registry = CollectorRegistry()
                registry.register(self.metrics_collector())
                try:
                    self.metrics_server = MetricsServer(registry, metrics_host, metrics_port)
                except BaseException:
                    self._router.close(linger=0)
                    self._pull.close()
                    self._ctx.term()
                    raise
                self.metrics_port = self.metrics_server.port
        except BaseException:
            self.engine.close()
            raise
        laps = self.engine.startup
        logger.info("engine ready in %.2f s (%s)", sum(laps.seconds.values()), laps)

    def metrics_collector(self):
        """A Prometheus collector of this core's series, labelled (model_name, engine)."""
        from headrace.metrics.exporter import EngineCollector

        return EngineCollector(self.engine.metrics, self.model_name, self.engine_id, self.engine.quantization,
                               self.engine.startup.seconds)

    # ---- lifecycle ----

    def start_io(self) -> None:
        self._io_thread = threading.Thread(target=self._io_loop, name="headrace-core-io", daemon=True)
        self._io_thread.start()

    def stop(self) -> None:
        """Make the loops end; safe in a signal handler (it takes no lock)."""
        self._stopping = True

    def serve_forever(self, parent_pid: int | None = None) -> None:
        """Run the busy loop until stop() (with parent_pid, also until that
        process is gone), then close the engine, releasing its device memory."""
        if self._io_thread is None:
            self.start_io()
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._out_address)
        try:
            while not self._stopping:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("parent process %d is gone; shutting down", parent_pid)
                    break
                self._handle_inbox(push, block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    self._send_outputs(push, self.engine.step())
        except Exception as e:  # the engine is broken (e.g. a tensor-parallel worker died): say why, then stop
            logger.exception("the engine failed")
            self._exit_reason = f"the engine core failed: {e}"
            raise
        finally:
            self._stopping = True
            push.close()
            if self._io_thread is not None:
                self._io_thread.join(timeout=5)
            self._ctx.term()
            if self.metrics_server is not None:
                self.metrics_server.close()
            self.engine.close()  # the server owns the engine: its device memory goes with the loop

    # ---- busy loop side ----

    def _handle_inbox(self, push: zmq.Socket, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            identity, msg = item
            try:
                self._handle(push, identity, msg)
            except Exception:  # one bad message must not take the core down
                logger.exception("error handling %s from frontend %s", type(msg).__name__, identity.hex())
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, push: zmq.Socket, identity: bytes, msg) -> None:
        if isinstance(msg, AddRequest):
            key = f"{identity.hex()}/{msg.request_id}"
            if key in self._owners:
                self._reply(push, identity, RequestError(request_id=msg.request_id,
                                                         message=f"request id {msg.request_id!r} is already in use"))
                return
            try:
                ids = unpack_ids(msg.prompt_token_ids).tolist()
                self.engine.add_request(key, ids, msg.sampling_params, msg.arrival_time)
            except ValueError as e:
                self._reply(push, identity, RequestError(request_id=msg.request_id, message=str(e)))
                return
            self._owners[key] = (identity, msg.request_id)
            self._by_frontend.setdefault(identity, set()).add(key)
        elif isinstance(msg, Abort):
            # an id may name one sample of an n > 1 request: "id#i"
            keys = [f"{identity.hex()}/{rid}" for rid in msg.request_ids]
            keys = [k for k in keys if k in self._owners or k.rpartition("#")[0] in self._owners]
            self.engine.abort(keys)
            self._forget([k for k in keys if k in self._owners and not self.engine.live(k)])
        elif isinstance(msg, GetStats):
            self._reply(push, identity, Stats(num_frontends=self._num_frontends, **self.engine.stats()))
        elif isinstance(msg, _Gone):
            keys = self._by_frontend.pop(identity, set())
            if keys:
                logger.info("frontend %s left; aborting its %d requests", identity.hex(), len(keys))
            self._forget(self.engine.abort(list(keys)))

    def _forget(self, keys) -> None:
        for key in keys:
            identity, _ = self._owners.pop(key)
            owned = self._by_frontend.get(identity)
            if owned is not None:
                owned.discard(key)

    def _send_outputs(self, push: zmq.Socket, outputs) -> None:
        by_frontend: dict[bytes, list] = {}
        done = []
        for out in outputs:
            key = out.request_id
            identity, request_id = self._owners[key]
            if out.finish_reason is not None and not self.engine.live(key):
                done.append(key)
            out.request_id = request_id
            by_frontend.setdefault(identity, []).append(out)
        self._forget(set(done))
        now = time.time()
        for identity, outs in by_frontend.items():
            self._reply(push, identity, StepOutputs(outputs=outs, timestamp=now))

    def _reply(self, push: zmq.Socket, identity: bytes, msg) -> None:
        push.send_multipart([identity, encode(msg)])

    # ---- I/O thread ----

    def _io_loop(self) -> None:
        router, pull = self._router, self._pull
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        interval, timeout = envs.heartbeat_interval(), envs.heartbeat_timeout()
        last_seen: dict[bytes, float] = {}  # frontends that said Hello -> when last heard
        # On an ipc address every frontend runs on this machine: watch its process too (a pidfd ->
        # its identity), so one that dies is dropped at once rather than after the heartbeat timeout.
        self._exits: dict[int, bytes] = {}
        self._poller = poller
        heartbeat = encode(Heartbeat())
        next_beat = time.monotonic()
        num_bad = 0
        try:
            while not self._stopping:
                events = dict(poller.poll(timeout=int(interval * 1000 / 2)))
                now = time.monotonic()
                for fd in [fd for fd in self._exits if fd in events]:
                    identity = self._unwatch(self._exits[fd])
                    if last_seen.pop(identity, None) is not None:
                        logger.warning("frontend %s exited; dropping it", identity.hex())
                        self._num_frontends = len(last_seen)
                        self._inbox.put((identity, _Gone()))
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if not self._on_frames(router, frames, last_seen, now):
                            num_bad += 1
                            if num_bad <= 10 or num_bad % 1000 == 0:
                                logger.warning("dropped a malformed message (%d so far)", num_bad)
                if pull in events:
                    while True:
                        try:
                            router.send_multipart(pull.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if now >= next_beat:
                    next_beat = now + interval
                    for identity, seen in list(last_seen.items()):
                        if now - seen > timeout:
                            logger.warning("frontend %s silent for %.1fs; dropping it", identity.hex(), now - seen)
                            del last_seen[identity]
                            self._unwatch(identity)
                            self._inbox.put((identity, _Gone()))
                        else:
                            router.send_multipart([identity, heartbeat])
                    self._num_frontends = len(last_seen)
            exit_msg = encode(CoreExit(reason=self._exit_reason))
            for identity in last_seen:
                router.send_multipart([identity, exit_msg])
        finally:
            for identity in list(self._exits.values()):
                self._unwatch(identity)
            router.close(linger=200)
            pull.close()

    def _watch(self, identity: bytes, pid: int) -> None:
        """Watch a frontend's process exit (ipc addresses only: there the pid is of this machine)."""
        self._unwatch(identity)
        if not self.address.startswith("ipc://"):
            return
        try:
            fd = watch_exit(pid)
        except ProcessLookupError:  # gone already: its silence drops it
            return
        if fd is not None:
            self._exits[fd] = identity
            self._poller.register(fd, zmq.POLLIN)

    def _unwatch(self, identity: bytes) -> bytes:
        for fd in [fd for fd, who in self._exits.items() if who == identity]:
            del self._exits[fd]
            self._poller.unregister(fd)
            os.close(fd)
        return identity

    def _on_frames(self, router: zmq.Socket, frames: list[bytes], last_seen: dict, now: float) -> bool:
        """Handle one incoming message; False if it was malformed."""
        if len(frames) != 2:
            return False
        identity, payload = frames
        try:
            msg = to_core_decoder.decode(payload)
        except Exception:  # msgspec raises DecodeError/ValidationError, and ValueError from SamplingParams
            return False
        if isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                logger.warning("frontend %s speaks protocol %d, not %d", identity.hex(), msg.protocol,
                               PROTOCOL_VERSION)
                return True
            last_seen[identity] = now
            self._num_frontends = len(last_seen)
            self._watch(identity, msg.pid)
            router.send_multipart([identity, self._ready])
            return True
        if identity not in last_seen:
            return False  # no Hello yet: not a frontend
        last_seen[identity] = now
        if isinstance(msg, Goodbye):
            del last_seen[identity]
            self._unwatch(identity)
            self._inbox.put((identity, _Gone()))
        elif not isinstance(msg, Ping):
            self._inbox.put((identity, msg))
        return True
