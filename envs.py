"""Every environment variable headrace reads, in one place, each with a HEADRACE_ prefix."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """HEADRACE_CACHE_DIR: where built artifacts (the demo checkpoint) are cached."""
    base = os.environ.get("HEADRACE_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headrace"


def log_level() -> str:
    """HEADRACE_LOG_LEVEL: the level of headrace's loggers (default INFO)."""
    return os.environ.get("HEADRACE_LOG_LEVEL", "INFO").upper()


def cpu_kv_cache_gb() -> float:
    """HEADRACE_CPU_KV_CACHE_GB: the most memory the KV pool may take on the CPU (default 4)."""
    return float(os.environ.get("HEADRACE_CPU_KV_CACHE_GB", "4"))


def heartbeat_interval() -> float:
    """HEADRACE_HEARTBEAT_INTERVAL: seconds between heartbeats, both ways (default 0.5)."""
    return float(os.environ.get("HEADRACE_HEARTBEAT_INTERVAL", "0.5"))


def heartbeat_timeout() -> float:
    """HEADRACE_HEARTBEAT_TIMEOUT: silence after which a peer counts as dead (default 3)."""
    return float(os.environ.get("HEADRACE_HEARTBEAT_TIMEOUT", "3"))


def cpu_threads() -> int:
    """HEADRACE_CPU_THREADS: torch intra-op threads for a CPU executor (default:
    one less than the CPUs this process may use, leaving one for the engine's
    socket and frontend threads; at least 1). Tensor-parallel ranks on the CPU split them."""
    value = os.environ.get("HEADRACE_CPU_THREADS")
    if value:
        return max(1, int(value))
    return max(1, len(os.sched_getaffinity(0)) - 1)


def api_key() -> str | None:
    """HEADRACE_API_KEY: the bearer token `headrace serve` requires on /v1/* (default: none)."""
    return os.environ.get("HEADRACE_API_KEY") or None


def fused_projections() -> bool:
    """HEADRACE_FUSED_PROJECTIONS: 0 runs a few-row step's float projections through
    cuBLAS with their norms and activation as separate kernels (default 1: kernels/dense.py)."""
    return _switch("HEADRACE_FUSED_PROJECTIONS")


def fused_decode() -> bool:
    """HEADRACE_FUSED_DECODE: 0 runs a decode step's rotary and KV-cache write as a
    kernel of its own before attention (default 1: inside the decode attention kernel)."""
    return _switch("HEADRACE_FUSED_DECODE")


def sampling_graphs() -> bool:
    """HEADRACE_SAMPLING_GRAPHS: 0 samples every decode step eagerly after its graph (default 1: a
    step whose rows all sample straight from their logits samples in a CUDA graph of its own)."""
    return _switch("HEADRACE_SAMPLING_GRAPHS")


def pdl() -> bool:
    """HEADRACE_PDL: 0 launches the Triton kernels without programmatic dependent
    launch (default 1: on a GPU that has it, compute capability 9.0 and up)."""
    return _switch("HEADRACE_PDL")


def int4_mma() -> bool:
    """HEADRACE_INT4_MMA: 0 runs a 4-bit layer's calls of 2 to 8 rows through the tl.dot
    kernel of kernels/int4.py (default 1: mma.sync, kernels/int4_mma.py, on an sm_90 GPU)."""
    return _switch("HEADRACE_INT4_MMA")


def _switch(name: str) -> bool:
    """An on (1, the default) / off (0) variable; anything else is refused."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
