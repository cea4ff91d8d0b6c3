"""headrace: an LLM inference and serving engine that one person can read and change."""
from headrace.core.config import ConfigError, EngineArgs
from headrace.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from headrace.core.sampling_params import RequestOutputKind, SamplingParams
from headrace.frontend.async_engine import AsyncEngine
from headrace.frontend.client import EngineDeadError
from headrace.frontend.llm import LLM

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
