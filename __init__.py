"""headrace: an LLM inference and serving engine that one person can read and change."""
from headrace.core.config import ConfigError, EngineArgs
from headrace.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from headrace.core.sampling_params import RequestOutputKind, SamplingParams
from headrace.frontend.async_engine import AsyncEngine
from headrace.frontend.client import EngineDeadError

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineDeadError",
    "RequestOutputKind",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EngineArgs",
    "ConfigError",
]


def __getattr__(name: str):
    # LLM runs an engine in this process and imports torch with it; a process
    # that only streams from cores (an API server, an application) never does.
    if name == "LLM":
        from headrace.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'headrace' has no attribute {name!r}")
