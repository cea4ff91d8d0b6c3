"""User-facing results, shaped as vLLM's: RequestOutput holds CompletionOutputs."""
from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, its rank among the
    vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Logprobs(Sequence):
    """Logprobs of consecutive positions: position -> {token id: Logprob}.

    Kept as the packed little-endian arrays that came over the wire; they
    are unpacked when first read, and a position's dict is built the first
    time that position is read, so an application that never looks at
    logprobs, or reads only a few positions, pays for no Python objects.
    It reads like a list of dicts (len, indexing, slices, iteration, ==),
    and list(logprobs) gives a plain one.

    Row i holds the scored token (the sampled or the prompt token) in
    column 0 and, in the other columns, the top-N in rank order or the
    requested logprob_token_ids (which have no rank: `ranked` is False).
    `num_empty` leading positions have no logprobs (None): the first prompt
    token has no context.
    """

    __slots__ = ("_packed", "_num", "_ranked", "_text", "_num_empty", "_built")

    def __init__(self, token_ids: bytes, values: bytes, ranks: bytes, ranked: bool, token_text: Sequence[str],
                 num_empty: int = 0) -> None:
        self._packed = (token_ids, values, ranks)  # int32 [num, k], float32 [num, k], int32 [num]
        self._num = len(ranks) // 4
        self._ranked = ranked
        self._text = token_text  # token id -> decoded text
        self._num_empty = num_empty
        self._built: list[dict[int, Logprob] | None] | None = None  # rows built so far

    def __len__(self) -> int:
        return self._num_empty + self._num

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("logprobs index out of range")
        row = index - self._num_empty
        if row < 0:
            return None
        if self._built is None:
            self._built = [None] * self._num
        entry = self._built[row]
        if entry is None:
            entry = self._built[row] = self._build(row)
        return entry

    def __iter__(self):
        for i in range(len(self)):  # Sequence's own __iter__ ends on an IndexError, which costs a raise
            yield self[i]

    def _build(self, row: int) -> dict[int, Logprob]:
        # One row straight from the wire bytes: struct unpacks a few values faster than numpy views do.
        ids, values, ranks = self._packed
        ints, floats = _row_structs(len(ids) // len(ranks))  # k columns: ids hold num * k int32s
        ids, values = ints.unpack_from(ids, row * ints.size), floats.unpack_from(values, row * floats.size)
        text, ranked = self._text, self._ranked
        entry = {t: Logprob(v, r if ranked else None, text[t]) for r, (t, v) in enumerate(zip(ids[1:], values[1:]), 1)}
        scored, rank = ids[0], _I32.unpack_from(ranks, row * 4)[0]
        if scored in entry:
            entry[scored].rank = rank
        else:
            entry[scored] = Logprob(values[0], rank, text[scored])
        return entry

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # mutable contents, like a list

    def __repr__(self) -> str:
        return f"Logprobs({list(self)!r})"


_I32 = struct.Struct("<i")


@functools.cache
def _row_structs(k: int) -> tuple[struct.Struct, struct.Struct]:
    """Little-endian int32 and float32 rows of k columns."""
    return struct.Struct(f"<{k}i"), struct.Struct(f"<{k}f")


# One dict per generated position: token id -> Logprob (a Logprobs, or a plain list).
SampleLogprobs = Sequence[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = field(default=None)
    # Prompt tokens the core found in its prefix cache when it first scheduled
    # the request (with n > 1, its first sample); None before the core said.
    num_cached_tokens: int | None = None


@dataclass
class BeamSearchSequence:
    """One beam of LLM.beam_search (vLLM's shape): tokens are the prompt's
    and the generated ones; text is the generated text."""

    tokens: list[int]
    logprobs: SampleLogprobs | None
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: its beams, best first."""

    sequences: list[BeamSearchSequence]
