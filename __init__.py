"""headrace: an LLM inference and serving engine that one person can read and change."""
import importlib

# name -> the module that defines it. Imported on first use: importing any
# part of headrace runs this file first, and a process that only streams from
# cores (an API server, an application) must not load what it never uses.
_EXPORTS = {
    "LLM": "headrace.frontend.llm",
    "AsyncEngine": "headrace.frontend.async_engine",
    "EngineDeadError": "headrace.frontend.client",
    "RequestOutputKind": "headrace.sampling_params",
    "SamplingParams": "headrace.sampling_params",
    "BeamSearchParams": "headrace.sampling_params",
    "BeamSearchOutput": "headrace.core.outputs",
    "BeamSearchSequence": "headrace.core.outputs",
    "RequestOutput": "headrace.core.outputs",
    "CompletionOutput": "headrace.core.outputs",
    "Logprob": "headrace.core.outputs",
    "RequestMetrics": "headrace.core.outputs",
    "EngineArgs": "headrace.config",
    "ConfigError": "headrace.checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'headrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
