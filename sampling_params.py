"""SamplingParams: how one request generates, validated at construction."""
from __future__ import annotations

import difflib
import enum
import math
from typing import Any

import msgspec

MAX_LOGPROBS = 20  # top-N logprobs per position, and prompt logprobs
MAX_LOGPROB_TOKEN_IDS = 128  # ids in logprob_token_ids
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_STOP_TOKEN_IDS = 64
MAX_BEST_OF = 128  # samples, or beams, of one request
EARLY_STOPPING = (True, False, "never")
ACT_FUNCS = ("log_softmax", "sigmoid")
TRUNCATION_SIDES = ("left", "right")
LOGPROBS_MODES = ("raw", "processed")


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM-compatible generation parameters of one request.

    Every field, its meaning and its range are listed in docs/sampling.md.
    Values out of range raise ValueError naming the field. Token ids are
    checked against the model's vocabulary when the request is submitted.
    """

    n: int = 1
    best_of: int | None = None  # samples (or beams) generated, of which the n best return; None = n
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search: hypotheses rank by cumulative_logprob / length ** length_penalty
    early_stopping: bool | str = False  # beam search: True, False or "never" (transformers' meaning)
    # beam search: the logits are divided by this before the beam scores (LLM.beam_search's temperature; 0 = none)
    beam_search_temperature: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    act_func: str | None = None
    logprobs_mode: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    # Prompt tokens kept, the last ones ("left": the start is cut) or the first ("right"); -1: as many as
    # max_model_len leaves beside max_tokens. Applied by the frontend before the prompt's length is checked.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # Filled by the frontend from bad_words: the token sequences to ban.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        for name, types in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ValueError(f"{name} must be of type {' or '.join(t.__name__ for t in types)}, got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                                 f"got {self.output_kind!r}") from None
        self._check_ranges()
        self._check_token_lists()
        self._check_best_of()
        self._resolve_act_func()
        self._check_truncation()
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES} or None, got {self.logprobs_mode!r}")

    def _check_ranges(self) -> None:
        _range("n", self.n, 1, 128)
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        _range("min_p", self.min_p, 0.0, 1.0)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _range(name, value, 0, MAX_LOGPROBS)

    def _check_truncation(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for what max_model_len allows, got {k}")
        if self.truncation_side not in TRUNCATION_SIDES:
            raise ValueError(f"truncation_side must be one of {TRUNCATION_SIDES}, got {self.truncation_side!r}")
        if k is None and self.truncation_side != "left":
            raise ValueError("truncation_side applies with truncate_prompt_tokens only; set it or leave "
                             "truncation_side at 'left'")

    def _check_best_of(self) -> None:
        if self.best_of is not None:
            _range("best_of", self.best_of, 1, MAX_BEST_OF)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.early_stopping not in EARLY_STOPPING:
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not 0.0 <= self.beam_search_temperature < float("inf"):
            raise ValueError(f"beam_search_temperature must be >= 0 and finite, got {self.beam_search_temperature}")
        if not self.use_beam_search:
            for name, default in (("length_penalty", 1.0), ("early_stopping", False), ("beam_search_temperature", 0.0)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name} applies to beam search only; set use_beam_search=True or leave "
                                     f"{name} at {default!r}")
            if self.best_of is not None and self.best_of > self.n and self.output_kind == RequestOutputKind.DELTA:
                raise ValueError("output_kind DELTA cannot stream best_of > n: which samples are the best "
                                 "changes as they grow; use CUMULATIVE or FINAL_ONLY")
            return
        # Beam search is deterministic: as vLLM's engine did, sampling settings are refused, not ignored.
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 with use_beam_search=True (beam search does not sample), got "
                             f"{self.temperature}; beam_search_temperature scales the logits of the beam scores")
        for name, off in (("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != off:
                raise ValueError(f"{name} must be {off} with use_beam_search=True (beam search does not sample), "
                                 f"got {getattr(self, name)}")
        if self.top_k not in (0, -1):
            raise ValueError(f"top_k must be 0 or -1 with use_beam_search=True (beam search does not sample), "
                             f"got {self.top_k}")
        if self.max_tokens is None:
            raise ValueError("beam search needs max_tokens (prompt-only requests have nothing to search)")
        if self.output_kind == RequestOutputKind.DELTA:
            raise ValueError("output_kind DELTA cannot stream beam search: the best beams change and reorder "
                             "every step; use CUMULATIVE (the current best n each step) or FINAL_ONLY")
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None)):
            if getattr(self, name) != off:
                raise ValueError(f"{name} is not supported with use_beam_search=True")

    @property
    def num_samples(self) -> int:
        """Samples (or beams) the engine runs for this request: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    def _check_token_lists(self) -> None:
        if self.stop is not None and not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.bad_words is not None and not all(isinstance(x, str) and x for x in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        _ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if self.allowed_token_ids is not None:
            _ids("allowed_token_ids", self.allowed_token_ids, None)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.logit_bias is not None:
            _ids("logit_bias", list(self.logit_bias), MAX_LOGIT_BIAS)
            for tid, bias in self.logit_bias.items():
                if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias[{tid}] must be a number in [-100, 100], got {bias!r}")
        if self.logprob_token_ids is not None:
            _ids("logprob_token_ids", self.logprob_token_ids, MAX_LOGPROB_TOKEN_IDS)
            if len(set(self.logprob_token_ids)) != len(self.logprob_token_ids):
                raise ValueError("logprob_token_ids must not repeat an id")
            if self.logprobs is not None and self.logprobs != len(self.logprob_token_ids):
                raise ValueError(
                    f"logprobs={self.logprobs} contradicts logprob_token_ids, which asks for "
                    f"{len(self.logprob_token_ids)} ids; leave logprobs unset (or equal to that count)"
                )
        if self.bad_words_token_ids is not None:
            for seq in self.bad_words_token_ids:
                _ids("bad_words_token_ids", seq, None)

    def _resolve_act_func(self) -> None:
        alias = (self.extra_args or {}).get("activation_func")
        if alias is not None:
            if self.act_func is not None and self.act_func != alias:
                raise ValueError(f"act_func={self.act_func!r} contradicts extra_args activation_func={alias!r}")
            self.act_func = alias
        if self.act_func is None:
            self.act_func = "log_softmax"
        if self.act_func not in ACT_FUNCS:
            hint = difflib.get_close_matches(str(self.act_func), ACT_FUNCS, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(f"act_func must be one of {ACT_FUNCS}, got {self.act_func!r}{did_you_mean}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_logprobs(self) -> int | None:
        """Entries per generated position besides the sampled token, or None."""
        if self.logprob_token_ids is not None:
            return len(self.logprob_token_ids)
        return self.logprobs


def check_token_ids(sp: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the field if a token id lies outside the vocabulary."""
    fields = {
        "logit_bias": list(sp.logit_bias or ()),
        "allowed_token_ids": sp.allowed_token_ids or [],
        "logprob_token_ids": sp.logprob_token_ids or [],
        "bad_words_token_ids": [t for seq in sp.bad_words_token_ids or () for t in seq],
    }
    for name, ids in fields.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _range(name: str, value, low, high) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _ids(name: str, ids: list, max_len: int | None) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{name} must hold non-negative integer token ids, got {ids!r}")
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"{name} holds {len(ids)} entries; at most {max_len} are allowed")


_TYPES = {
    "n": (int,),
    "best_of": (int, type(None)),
    "use_beam_search": (bool,),
    "length_penalty": (float, int),
    "early_stopping": (bool, str),
    "beam_search_temperature": (float, int),
    "temperature": (float, int),
    "top_p": (float, int),
    "top_k": (int,),
    "min_p": (float, int),
    "seed": (int, type(None)),
    "presence_penalty": (float, int),
    "frequency_penalty": (float, int),
    "repetition_penalty": (float, int),
    "logit_bias": (dict, type(None)),
    "allowed_token_ids": (list, type(None)),
    "bad_words": (list, type(None)),
    "max_tokens": (int, type(None)),
    "min_tokens": (int,),
    "ignore_eos": (bool,),
    "stop_token_ids": (list,),
    "stop": (list, str, type(None)),
    "include_stop_str_in_output": (bool,),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    "logprob_token_ids": (list, type(None)),
    "act_func": (str, type(None)),
    "logprobs_mode": (str, type(None)),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "extra_args": (dict, type(None)),
    "truncate_prompt_tokens": (int, type(None)),
    "truncation_side": (str,),
    "bad_words_token_ids": (list, type(None)),
}


class BeamSearchParams(msgspec.Struct, kw_only=True, frozen=True):
    """LLM.beam_search's parameters (vLLM's names): beam search of beam_width
    beams, every beam returned. temperature divides the logits before the
    beam scores (0: not at all)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def sampling_params(self) -> SamplingParams:
        """The same search as SamplingParams (raises ValueError naming a bad field)."""
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool):
            raise ValueError(f"beam_width must be an integer, got {self.beam_width!r}")
        _range("beam_width", self.beam_width, 1, MAX_BEST_OF)
        return SamplingParams(
            n=self.beam_width, best_of=self.beam_width, use_beam_search=True, temperature=0.0,
            beam_search_temperature=self.temperature, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty, output_kind=RequestOutputKind.FINAL_ONLY)
