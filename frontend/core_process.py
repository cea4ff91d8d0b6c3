"""Spawning an engine-core process that never outlives its parent."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile

from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.paths import resolve_model_path
from headrace.config import EngineArgs
from headrace.lifetime import terminate


def private_ipc_address() -> tuple[str, str]:
    """An ipc address inside a fresh owner-only directory; returns (address, directory)."""
    directory = tempfile.mkdtemp(prefix="headrace-")  # mode 0700
    return f"ipc://{directory}/core.sock", directory


def remove_private_ipc(address: str, directory: str) -> None:
    """Remove what private_ipc_address made: the socket file, if the core left one, and its directory."""
    try:
        os.unlink(address[len("ipc://"):])
    except FileNotFoundError:
        pass
    os.rmdir(directory)


def engine_args_to_cli(args: EngineArgs) -> list[str]:
    flags = []
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if value is None or value == field.default and field.name != "model" or value == ():
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, tuple):
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"a spawned core takes {field.name} as 'module:Class' strings, got {value!r}")
            flags += [flag, *value]
        elif isinstance(value, bool):
            flags.append(flag if value else "--no-" + field.name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


STARTUP_FAILED = "headrace core: failed: "  # the line a core prints before exiting when it cannot start


class CoreProcess:
    """A `headrace core` child process serving on a private ipc socket."""

    def __init__(self, proc: subprocess.Popen, address: str, directory: str | None, has_metrics: bool = False) -> None:
        self.proc = proc
        self.address = address
        self._directory = directory
        self._has_metrics = has_metrics
        self._failure: str | None = None  # why it failed to start, once read

    @classmethod
    def spawn(cls, args: EngineArgs, address: str | None = None, metrics_port: int | None = None,
              data_parallel_rank: int = 0) -> CoreProcess:
        """data_parallel_rank: the core's place among data-parallel cores (on
        GPUs it takes tensor_parallel_size of them from rank * tensor_parallel_size)."""
        # Refuse a bad model here, with the checkpoint reader's own message,
        # rather than as a dead child process.
        ModelConfig.from_dir(resolve_model_path(args.model))
        directory = None
        if address is None:
            address, directory = private_ipc_address()
        cmd = [sys.executable, "-m", "headrace.frontend.cli", "core", "--address", address,
               "--parent-pid", str(os.getpid()), *engine_args_to_cli(args)]
        if metrics_port is not None:
            cmd += ["--metrics-port", str(metrics_port)]
        if data_parallel_rank:
            cmd += ["--data-parallel-rank", str(data_parallel_rank)]
        # Logs go to stderr; stdout carries the start-up lines (read by
        # metrics_url and startup_failure): a few lines, so the pipe never fills.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        return cls(proc, address, directory, metrics_port is not None)

    def metrics_url(self) -> str:
        """Wait until the core is serving (its model loaded) and return the URL
        of its metrics; a core spawned without metrics_port has none to give."""
        if not self._has_metrics:
            raise ValueError("this core was spawned without metrics_port")
        for line in self.proc.stdout:  # "headrace core: serving ...", then "headrace core: metrics at URL"
            if line.startswith("headrace core: metrics at "):
                return line.split(" at ", 1)[1].strip()
            self._note_failure(line)
        code = self.proc.wait()
        raise RuntimeError(f"the engine core exited during start-up (exit code {code}): "
                           f"{self._failure or 'its log is above'}")

    def startup_failure(self) -> str | None:
        """Why a core that exited during start-up failed (its error), if it said."""
        if self._failure is None and self.proc.poll() is not None:
            for line in self.proc.stdout:
                self._note_failure(line)
        return self._failure

    def _note_failure(self, line: str) -> None:
        if line.startswith(STARTUP_FAILED):
            self._failure = line[len(STARTUP_FAILED):].strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)
        if self._directory is not None:
            remove_private_ipc(self.address, self._directory)
            self._directory = None
