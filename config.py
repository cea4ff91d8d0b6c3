"""The engine's settings: what a user sets (EngineArgs), and the frozen
configs the scheduler and KV cache are built from, resolved once at start-up."""
from __future__ import annotations

from dataclasses import dataclass

from headrace.checkpoint.config import DTYPES, ModelConfig
from headrace.checkpoint.quant_config import METHODS as QUANTIZATIONS


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets when starting an engine; validated at construction.

    num_kv_blocks None sizes the KV pool to hold max_num_seqs sequences of
    max_model_len tokens, within the device's KV memory budget:
    HEADRACE_CPU_KV_CACHE_GB on the CPU; on a GPU, gpu_memory_utilization of
    the card less the weights and the profiled peak of a full step.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs (only a GPU captures any)
    async_scheduling: bool = True  # schedule step N+1 while the device runs step N
    enable_prefix_caching: bool = True
    seed: int = 0
    logprobs_mode: str = "raw"
    logits_processors: tuple = ()
    tensor_parallel_size: int = 1  # ranks (worker processes, one GPU each) that split the model
    # True: every tensor-parallel all-reduce through NCCL (gloo on the CPU),
    # none through peer GPU memory (executor/all_reduce.py)
    disable_custom_all_reduce: bool = False
    # None: as the checkpoint is stored (its quantization_config; a GGUF file's
    # blocks packed on a GPU). "fp8" also quantizes a float checkpoint's
    # projections at load; "awq", "gptq" and "gguf" name the checkpoint's own
    # format (executor/models/quant.py)
    quantization: str | None = None
    # A GGUF file's quantized weights dequantized at load to the model dtype
    # (more memory, plain GEMMs) instead of kept packed
    dequantize_gguf: bool = False
    # With a quantization in force (not GGUF), the embedding table and the LM
    # head (one table when tied) in FP8 E4M3 too, one scale per row
    quantize_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("enforce_eager", "async_scheduling", "enable_prefix_caching", "disable_custom_all_reduce",
                     "dequantize_gguf", "quantize_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if isinstance(self.logits_processors, (str, type)) or not isinstance(self.logits_processors, (tuple, list)):
            raise ValueError("logits_processors must be a sequence of LogitsProcessor classes or "
                             "'module:Class' strings")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and not all(isinstance(p, str) for p in self.logits_processors):
            raise ValueError("with tensor_parallel_size > 1 the workers load logits_processors themselves: "
                             "give them as 'module:Class' strings")

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return self.max_model_len


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
