"""`headrace serve` in a process of its own, for the HTTP API tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from headrace.lifetime import terminate

FLAGS = ("--max-model-len", "256", "--block-size", "8")


class Serve:
    """A running `headrace serve`: its process, base URL (…/v1) and core address."""

    def __init__(self, model, *extra: str, env: dict | None = None, timeout: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "headrace.frontend.cli", "serve", "--model", str(model), "--port", "0",
               *FLAGS, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        lines = _read_lines(self.proc, 2, timeout)
        m = re.search(r"at (http://\S+/v1)", lines[0]) if lines else None
        if m is None or len(lines) < 2:
            self.stop()
            raise RuntimeError(f"headrace serve did not start: {lines!r}")
        self.base_url = m.group(1)
        self.root = self.base_url[: -len("/v1")]
        self.core_address = lines[1].split(" at ", 1)[1].split()[0]

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.root + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels) -> float:
        """The sum of a metric's samples on /metrics whose labels include labels."""
        _, page = self.get("/metrics")
        total = 0.0
        for line in page.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> int:
        return terminate(self.proc, 45)  # serve's drain may take its 30 s shutdown timeout


def _read_lines(proc: subprocess.Popen, n: int, timeout: float) -> list[str]:
    """Up to n lines of proc's stdout, waiting at most timeout seconds in all."""
    lines: list[str] = []

    def read() -> None:
        for _ in range(n):
            line = proc.stdout.readline()
            if not line:
                return
            lines.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return list(lines)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
