"""The frontend's connection to an engine core (asyncio, ZeroMQ DEALER).

One background task reads the socket and hands messages to the owner's
callbacks; another sends heartbeats and watches the core's: silence longer
than the heartbeat timeout, a CoreExit message, or the exit of a core
process this frontend spawned all mark the core dead, and every pending
and later call then fails with EngineDeadError.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from headrace import envs
from headrace.core.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    CoreExit,
    GetStats,
    Goodbye,
    Hello,
    Ping,
    Ready,
    RequestError,
    Stats,
    StepOutputs,
    encode,
    from_core_decoder,
    pack_ids,
)
from headrace.core.sampling_params import SamplingParams

logger = logging.getLogger("headrace.frontend")


class EngineDeadError(RuntimeError):
    """The engine core stopped answering or exited; requests on it cannot finish."""


class EngineClient:
    def __init__(
        self,
        address: str,
        on_outputs: Callable[[StepOutputs], None],
        on_error: Callable[[RequestError], None],
        on_dead: Callable[[EngineDeadError], None],
        is_core_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.address = address
        self.identity = uuid.uuid4().bytes
        self.ready: Ready | None = None
        self.dead: EngineDeadError | None = None
        self._on_outputs, self._on_error, self._on_dead = on_outputs, on_error, on_dead
        self._is_core_alive = is_core_alive
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._stats_waiters: list[asyncio.Future] = []
        self._last_heard = 0.0

    async def start(self, timeout: float = 600.0) -> Ready:
        """Connect and handshake; waits for a starting core to load its model."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._sock = sock
        deadline = time.monotonic() + timeout
        hello = encode(Hello(protocol=PROTOCOL_VERSION, pid=os.getpid()))
        await sock.send(hello)
        next_hello = time.monotonic() + 2.0
        while self.ready is None:
            if self._is_core_alive is not None and not self._is_core_alive():
                raise EngineDeadError("the engine core process exited during start-up (see its log above)")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"no engine core answered at {self.address} within {timeout:.0f}s")
            if await sock.poll(200):
                msg = self._decode(await sock.recv())
                if isinstance(msg, Ready):
                    self.ready = msg
            elif time.monotonic() > next_hello:  # a core that binds late missed the first Hello
                await sock.send(hello)
                next_hello = time.monotonic() + 2.0
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_loop())]
        return self.ready

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  arrival_time: float) -> None:
        await self._send(AddRequest(request_id=request_id, prompt_token_ids=pack_ids(prompt_token_ids),
                                    sampling_params=params, arrival_time=arrival_time))

    async def abort(self, request_ids: list[str]) -> None:
        await self._send(Abort(request_ids=list(request_ids)))

    async def stats(self) -> Stats:
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._send(GetStats())
        return await fut

    async def close(self) -> None:
        if self._sock is None:
            return
        if self.dead is None:
            try:
                await asyncio.wait_for(self._sock.send(encode(Goodbye())), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()
        self._sock = None

    async def _send(self, msg) -> None:
        if self.dead is not None:
            raise self.dead
        await self._sock.send(encode(msg))

    def _decode(self, payload: bytes):
        try:
            return from_core_decoder.decode(payload)
        except Exception:
            logger.warning("dropped a malformed message from the engine core")
            return None

    async def _recv_loop(self) -> None:
        while True:
            msg = self._decode(await self._sock.recv())
            self._last_heard = time.monotonic()
            if isinstance(msg, StepOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, RequestError):
                self._on_error(msg)
            elif isinstance(msg, Stats):
                while self._stats_waiters:
                    fut = self._stats_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
                        break
            elif isinstance(msg, CoreExit):
                self._die(EngineDeadError(f"the engine core exited: {msg.reason}"))
                return

    async def _watch_loop(self) -> None:
        interval, timeout = envs.heartbeat_interval(), envs.heartbeat_timeout()
        ping = encode(Ping())
        while True:
            await asyncio.sleep(interval)
            if self._is_core_alive is not None and not self._is_core_alive():
                self._die(EngineDeadError("the engine core process exited"))
                return
            silent = time.monotonic() - self._last_heard
            if silent > timeout:
                self._die(EngineDeadError(f"the engine core has been silent for {silent:.1f}s"))
                return
            await self._sock.send(ping)

    def _die(self, err: EngineDeadError) -> None:
        if self.dead is not None:
            return
        self.dead = err
        logger.error("%s", err)
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(err)
        self._stats_waiters.clear()
        self._on_dead(err)
