"""Engine cores in processes of their own, for the tests that talk to them over ZeroMQ."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from headrace import AsyncEngine, EngineDeadError


def start_core(model, address: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`headrace core` in its own process (inheriting this one's environment);
    returns it and the address it serves. Further lines of its stdout (the
    metrics address, with --metrics-port) are left for the caller."""
    cmd = [sys.executable, "-m", "headrace.frontend.cli", "core", "--model", str(model), "--address", address,
           "--max-model-len", "256", "--block-size", "8", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving" in line, f"core did not start: {line!r}"
    return proc, line.rsplit(" at ", 1)[1].strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


async def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0):
    """Poll the core until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        s = await engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks \
                and s.num_slots_used == 0:
            return s
        assert time.monotonic() < deadline, f"core still busy: {s}"
        await asyncio.sleep(0.1)


def assert_core_idle(address: str) -> None:
    """Join the core at address and wait until it is idle with every KV block free (else AssertionError)."""
    async def check():
        async with AsyncEngine.connect(address) as engine:
            await wait_until_idle(engine)

    asyncio.run(check())


async def seconds_until_dead(streams, since: float, timeout: float) -> list[float]:
    """Drain every generate() stream, each of which must end in
    EngineDeadError: how long after `since` (time.monotonic) each did."""
    async def drain(stream):
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        return time.monotonic() - since

    return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout)
