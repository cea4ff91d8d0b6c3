"""Child processes that never outlive their parent."""
from __future__ import annotations

import os
import signal
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
