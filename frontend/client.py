"""The frontend's connection to an engine core.

A thread of its own owns the ZeroMQ DEALER socket, as the core's I/O thread
owns its ROUTER: it makes the handshake, forwards what the event loop sends,
pings the core every heartbeat interval, reads whatever the core sends, and
hands decoded messages to the event loop in batches. Every frame from the
core counts as a sign of life. Liveness is thus a matter of the two
processes, not of how busy the event loop is: a loop blocked for seconds
neither loses its core nor is dropped by it, and catches up when it runs.

The core is declared dead when it is silent for longer than the heartbeat
timeout, says CoreExit, or exits. Its exit is seen at once where the
address is ipc (the core runs on this machine and Ready gives its pid,
watched through a pidfd on Linux); a core joined over tcp has only the
heartbeats. From then on every call fails with EngineDeadError, and
receive() hands the error to the loop after the messages that came before
it.

Threads: the event loop's thread sends through an inproc PAIR socket that
only it uses; the I/O thread reads the other end. Received messages go the
other way through a deque, with a wake-up scheduled on the loop only when
the deque was not already due to be drained.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import zmq

from headrace import envs
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
    Stats,
    encode,
    from_core_decoder,
    pack_ids,
)
from headrace.lifetime import watch_exit
from headrace.sampling_params import SamplingParams

logger = logging.getLogger("headrace.frontend")
_STOP = b""  # on the inproc socket: the loop asks the I/O thread to say Goodbye and end


class EngineDeadError(RuntimeError):
    """The engine core stopped answering or exited; requests on it cannot finish."""


class EngineRestartingError(EngineDeadError):
    """The engine core died and a frontend that reconnects waits for it to be
    restarted at its address: a request may succeed later."""


class EngineClient:
    def __init__(self, address: str, is_core_alive: Callable[[], bool] | None = None) -> None:
        self.address = address
        self.identity = uuid.uuid4().bytes
        self.ready: Ready | None = None
        self.dead: EngineDeadError | None = None  # set by the I/O thread
        self._is_core_alive = is_core_alive
        self._ctx: zmq.Context | None = None
        self._to_io: zmq.Socket | None = None  # the loop's end of the inproc pair
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque = deque()  # decoded messages (and a final EngineDeadError) for the loop
        self._wake = asyncio.Event()
        self._wake_due = False  # a wake-up is scheduled on the loop and has not run yet
        self._stats_waiters: deque[asyncio.Future] = deque()

    async def start(self, timeout: float = 600.0) -> Ready:
        """Connect and handshake; waits for a starting core to load its model."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        pair = f"inproc://headrace-client-{self.identity.hex()}"
        self._to_io = self._ctx.socket(zmq.PAIR)
        self._to_io.setsockopt(zmq.SNDHWM, 0)  # never block the loop: the I/O thread drains it
        self._to_io.bind(pair)
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._io_main, args=(pair, started, timeout),
                                        name="headrace-frontend-io", daemon=True)
        self._thread.start()
        try:
            self.ready = await asyncio.wrap_future(started)
        except BaseException:
            await self.close()
            raise
        return self.ready

    # ---- the event loop's side ----

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float) -> None:
        self._send(AddRequest(request_id=request_id, prompt_token_ids=pack_ids(prompt_token_ids),
                              sampling_params=params, arrival_time=arrival_time))

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(request_ids=list(request_ids)))

    async def stats(self) -> Stats:
        fut = self._loop.create_future()
        self._stats_waiters.append(fut)
        self._send(GetStats())
        return await fut

    def on_stats(self, msg: Stats) -> None:
        """Answer the oldest stats() call still waiting."""
        while self._stats_waiters:
            fut = self._stats_waiters.popleft()
            if not fut.done():
                fut.set_result(msg)
                return

    async def receive(self) -> list:
        """The messages received since the last call, oldest first; waits for one.
        The last item is an EngineDeadError once the core is dead."""
        inbox = self._inbox
        while not inbox:
            self._wake.clear()
            if inbox:  # arrived before the clear, its wake-up already spent
                break
            await self._wake.wait()
        return [inbox.popleft() for _ in range(len(inbox))]

    def _send(self, msg) -> None:
        if self.dead is not None:
            raise self.dead
        self._to_io.send(encode(msg))

    async def close(self) -> None:
        """Say Goodbye (if the core lives), end the I/O thread, close the sockets."""
        if self._to_io is None:
            return
        if self._thread is not None and self._thread.is_alive():
            self._to_io.send(_STOP)
            await asyncio.to_thread(self._thread.join, 5.0)
        self._to_io.close(linger=0)
        self._to_io = None
        if self._thread is None or not self._thread.is_alive():
            self._ctx.term()  # would wait for the I/O thread's sockets
        else:
            logger.warning("the frontend I/O thread did not stop; leaving its sockets")
        self.fail_waiters(self.dead or EngineDeadError("the engine client is closed"))

    def fail_waiters(self, err: EngineDeadError) -> None:
        """Fail the stats() calls still waiting (the core died, or we leave)."""
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(err)
        self._stats_waiters.clear()

    def _wake_loop(self) -> None:
        self._wake_due = False
        self._wake.set()

    # ---- the I/O thread ----

    def _io_main(self, pair: str, started: concurrent.futures.Future, timeout: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.SNDHWM, 0)  # a slow core delays requests; it never drops them
        sock.connect(self.address)
        from_loop = self._ctx.socket(zmq.PAIR)
        from_loop.connect(pair)
        try:
            try:
                ready = self._handshake(sock, from_loop, timeout)
            except BaseException as e:
                _settle(started, error=e)
                return
            if ready is None:
                _settle(started, error=EngineDeadError("the engine client was closed during start-up"))
                return
            if _settle(started, result=ready):
                self._serve(sock, from_loop, ready.pid)
        finally:
            from_loop.close(linger=0)
            # Let a Goodbye reach the core; a dead core gets nothing.
            sock.close(linger=1000 if self.dead is None else 0)

    def _handshake(self, sock: zmq.Socket, from_loop: zmq.Socket, timeout: float) -> Ready | None:
        """Hello until Ready (a core that binds late misses the first); None if the loop stopped us."""
        deadline = time.monotonic() + timeout
        hello = encode(Hello(protocol=PROTOCOL_VERSION, pid=os.getpid()))
        sock.send(hello)
        next_hello = time.monotonic() + 2.0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(from_loop, zmq.POLLIN)
        while True:
            if self._is_core_alive is not None and not self._is_core_alive():
                raise EngineDeadError("the engine core process exited during start-up (see its log above)")
            now = time.monotonic()
            if now > deadline:
                raise EngineDeadError(f"no engine core answered at {self.address} within {timeout:.0f}s")
            events = dict(poller.poll(200))
            if from_loop in events and _STOP in _drain(from_loop):
                return None
            if sock in events:
                for frame in _drain(sock):
                    msg = self._decode(frame)
                    if isinstance(msg, Ready):
                        return msg
            elif now > next_hello:
                sock.send(hello)
                next_hello = now + 2.0

    def _serve(self, sock: zmq.Socket, from_loop: zmq.Socket, core_pid: int) -> None:
        """Until the loop says stop or the core is dead."""
        interval, timeout = envs.heartbeat_interval(), envs.heartbeat_timeout()
        ping = encode(Ping())
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(from_loop, zmq.POLLIN)
        last_heard = time.monotonic()
        next_ping = last_heard + interval
        try:
            exit_fd = watch_exit(core_pid) if self.address.startswith("ipc://") else None
        except ProcessLookupError:
            return self._die(f"the engine core process (pid {core_pid}) exited")
        if exit_fd is not None:
            poller.register(exit_fd, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(max(0.0, next_ping - time.monotonic()) * 1000))
                now = time.monotonic()
                if sock in events:  # what the core sent before it exited, first
                    frames = _drain(sock)
                    last_heard = now
                    msgs = []
                    for frame in frames:
                        msg = self._decode(frame)
                        if isinstance(msg, CoreExit):
                            self._deliver(msgs)
                            return self._die(f"the engine core exited: {msg.reason}")
                        if msg is not None and not isinstance(msg, Heartbeat):
                            msgs.append(msg)
                    self._deliver(msgs)
                if exit_fd in events:
                    return self._die(f"the engine core process (pid {core_pid}) exited")
                if from_loop in events:
                    for frame in _drain(from_loop):
                        if frame == _STOP:
                            sock.send(encode(Goodbye()), zmq.NOBLOCK)
                            return
                        sock.send(frame, zmq.NOBLOCK)
                if now >= next_ping:
                    next_ping = now + interval
                    if self._is_core_alive is not None and not self._is_core_alive():
                        return self._die("the engine core process exited")
                    if now - last_heard > timeout:
                        return self._die(f"the engine core has been silent for {now - last_heard:.1f}s")
                    sock.send(ping, zmq.NOBLOCK)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)

    def _decode(self, payload: bytes):
        try:
            return from_core_decoder.decode(payload)
        except Exception:
            logger.warning("dropped a malformed message from the engine core")
            return None

    def _deliver(self, msgs: list) -> None:
        if not msgs:
            return
        self._inbox.extend(msgs)
        if not self._wake_due:
            self._wake_due = True
            try:
                self._loop.call_soon_threadsafe(self._wake_loop)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

    def _die(self, reason: str) -> None:
        err = EngineDeadError(reason)
        logger.error("%s", err)
        self.dead = err
        self._deliver([err])


def _settle(fut: concurrent.futures.Future, result=None, error: BaseException | None = None) -> bool:
    """Set fut's outcome unless the waiting side gave up on it (cancelled it): whether it was set."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        return True
    except concurrent.futures.InvalidStateError:
        return False


def _drain(sock: zmq.Socket) -> list[bytes]:
    """Every frame waiting on sock."""
    frames = []
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames
