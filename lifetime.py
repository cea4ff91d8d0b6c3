"""Child processes that never outlive their parent, noticing another process's exit at once, and keeping
a process's long-lived heap out of the garbage collector's scans."""
from __future__ import annotations

import contextlib
import gc
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


def freeze_heap() -> None:
    """For a process that serves one engine until it exits (a spawned core, a tensor-parallel worker, an API
    server of `headrace serve`), once the engine is built or connected: collect, then freeze what is alive
    (torch, the model, the imported modules, the tokenizer) out of the garbage collector's scans. A full
    collection otherwise walks those few hundred thousand objects: in a long run of the community workload
    each held the host 0.1-0.3 s, the GPU idle meanwhile (benchmarks/RESULTS.md). Not for a process that
    builds and drops engines (LLM, tests): an engine it dropped into a garbage cycle after this ran would keep
    its memory until the process exits; there, heap_frozen() around the work."""
    gc.collect()  # garbage frozen would never be freed
    gc.freeze()


@contextlib.contextmanager
def heap_frozen():
    """freeze_heap's effect for the length of a block, in a process that goes on afterwards (LLM.generate,
    the benchmarks' in-process runs): what is alive at its start is frozen (without a collection: garbage
    frozen here is freed after the block), and at its end the whole permanent generation is unfrozen, so
    nothing stays out of the collector's reach. That includes what was frozen before the block, and the
    block freezes whatever is frozen already: an interpreter may freeze some objects at startup (a
    Python 3.12.3 build was seen starting with 375), so a frozen count above zero does not mean the heap
    is frozen. A caller that keeps its own heap frozen freezes again afterwards. Not nested: the inner
    block's end would unfreeze the outer one's heap."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
