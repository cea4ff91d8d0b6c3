"""Typed messages between frontends and the engine core, and their wire format.

Every message is one msgspec struct encoded as one msgpack frame; the
struct's tag says which. Token ids and logprobs travel as packed
little-endian arrays (int32 ids, float32 values) in bytes fields. Nothing
is pickled. A frame that does not decode to a known message is dropped by
the receiver.
"""
from __future__ import annotations

import struct

import msgspec
import numpy as np

from headrace.sampling_params import SamplingParams

PROTOCOL_VERSION = 6


_INT32 = struct.Struct("<i")


def pack_ids(ids) -> bytes:
    if type(ids) is list and len(ids) == 1 and type(ids[0]) is int:  # one new token: the common case
        return _INT32.pack(ids[0])
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


def unpack_id_list(data: bytes) -> list[int]:
    if len(data) == 4:  # one new token: the common case
        return [_INT32.unpack(data)[0]]
    return np.frombuffer(data, dtype="<i4").tolist()


def pack_floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


class _Msg(msgspec.Struct, tag_field="t", kw_only=True, forbid_unknown_fields=True):
    pass


# ---- frontend -> core ----


class Hello(_Msg, tag="hello"):
    """The first message of a frontend; the core answers with Ready."""

    protocol: int
    pid: int


class AddRequest(_Msg, tag="add"):
    request_id: str
    prompt_token_ids: bytes  # int32 [num_prompt_tokens]
    sampling_params: SamplingParams
    arrival_time: float


class Abort(_Msg, tag="abort"):
    request_ids: list[str]


class Ping(_Msg, tag="ping"):
    pass


class GetStats(_Msg, tag="get_stats"):
    pass


class Goodbye(_Msg, tag="bye"):
    """A frontend leaving: the core aborts its requests at once."""


ToCore = Hello | AddRequest | Abort | Ping | GetStats | Goodbye


# ---- core -> frontend ----


class Ready(_Msg, tag="ready"):
    """The handshake: what a frontend needs to tokenize, validate and decode."""

    protocol: int
    engine_id: str
    model: str
    tokenizer: str  # the tokenizer's source: the model, or the tokenizer the core was given
    # The prepared tokenizer's files (checkpoint/tokenizer.py): a frontend
    # needs no files of its own, wherever it runs.
    tokenizer_json: str
    tokenizer_meta: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    block_size: int
    num_kv_blocks: int
    pid: int  # the core's process: a frontend on the same machine (an ipc address) watches it exit


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one request.

    Logprobs, when asked for, come per new token as k = 1 + N columns: the
    sampled token first, then the top-N in rank order or the requested
    logprob_token_ids; their values are after the request's act_func.
    sampled_logprobs holds the sampled tokens' log_softmax values, which
    cumulative_logprob sums whatever act_func says.
    """

    request_id: str
    new_token_ids: bytes  # int32 [num_new]
    index: int = 0  # which of the request's n samples
    logprob_token_ids: bytes = b""  # int32 [num_new, k]
    logprobs: bytes = b""  # float32 [num_new, k]
    sampled_ranks: bytes = b""  # int32 [num_new]
    sampled_logprobs: bytes = b""  # float32 [num_new]
    # With the first output of a request that asked for prompt_logprobs: row
    # i scores prompt token i + 1 (the prompt token first, then the top-k).
    prompt_logprob_token_ids: bytes = b""  # int32 [num_prompt - 1, 1 + k]
    prompt_logprobs: bytes = b""  # float32 [num_prompt - 1, 1 + k]
    prompt_ranks: bytes = b""  # int32 [num_prompt - 1]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # a stop token id (or, for beam search, a stop string)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Beam search: the token ids and logprobs are the sample's whole output,
    # which replaces what came before (the best beams change as they fork).
    replace: bool = False
    # Beam search and best_of > n: the sample's cumulative score so far, by
    # which the frontend ranks best_of's samples.
    cumulative_logprob: float | None = None


class StepOutputs(_Msg, tag="outputs"):
    """One step's outputs for one frontend's requests."""

    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0  # time.time() at the end of the step, for inter-token latency


class RequestError(_Msg, tag="error"):
    """The core refused a request; nothing of it remains in the core."""

    request_id: str
    message: str


class Heartbeat(_Msg, tag="heartbeat"):
    pass


class Stats(_Msg, tag="stats"):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_slots_used: int
    num_preemptions: int
    num_steps: int
    step_seconds: float  # wall time the busy loop spent in steps
    num_frontends: int


class CoreExit(_Msg, tag="exit"):
    """The core is shutting down; its frontends fail their requests at once."""

    reason: str


FromCore = Ready | StepOutputs | RequestError | Heartbeat | Stats | CoreExit

_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
