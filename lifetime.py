"""Child processes that never outlive their parent, and noticing another process's exit at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel send SIGTERM when the parent exits (Linux); a child's
    own loop should also check getppid() for other systems and for a parent
    that died before this ran, which exits here."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        sys.exit(0)


def watch_exit(pid: int) -> int | None:
    """A file descriptor that becomes readable when process pid exits (a Linux
    pidfd, for any process of this machine, child or not), or None where the
    system has none (then only heartbeats tell). The caller closes it. Raises
    ProcessLookupError if pid is already gone."""
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if isinstance(e, ProcessLookupError):
            raise
        return None  # a kernel before 5.3, or a sandbox that refuses it


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM proc if it runs, wait up to timeout seconds, then SIGKILL it; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
