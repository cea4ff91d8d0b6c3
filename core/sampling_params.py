"""SamplingParams: how one request generates, validated at construction."""
from __future__ import annotations

import enum

import msgspec

# Largest number of top logprobs a request may ask for per position.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM-compatible generation parameters of one request.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1 and
    min_p 0 disable those filters. max_tokens None generates until the
    model's length limit. logprobs N returns the top-N log-probabilities of
    each generated position plus the sampled token's.

    Stop strings, output kinds and detokenization options are applied by
    the frontend: `stop` ends a request when its text contains one of the
    strings (the match is cut off unless include_stop_str_in_output), and
    no streamed text ever shows a match or what follows it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name, types in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ValueError(f"{name} must be of type {' or '.join(t.__name__ for t in types)}, got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                                 f"got {self.output_kind!r}") from None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported yet), got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_TYPES = {
    "n": (int,),
    "temperature": (float, int),
    "top_p": (float, int),
    "top_k": (int,),
    "min_p": (float, int),
    "seed": (int, type(None)),
    "max_tokens": (int, type(None)),
    "ignore_eos": (bool,),
    "stop_token_ids": (list,),
    "logprobs": (int, type(None)),
    "stop": (list, str, type(None)),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
}
