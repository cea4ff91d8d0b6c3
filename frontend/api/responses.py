"""Response bodies in OpenAI's shapes, built as plain dicts for msgspec.json.

Logprobs: a completion's are {tokens, token_logprobs, top_logprobs,
text_offset} (the legacy shape; top_logprobs maps token text -> logprob and
holds the chosen token too), a chat completion's are {content: [{token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}. JSON has no
-inf: a token the sampler could not choose gets -9999.0, as vLLM does.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from headrace.core.outputs import Logprob

NEG_INF_LOGPROB = -9999.0


def clamp(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LegacyLogprobs:
    """A completion choice's logprobs, built up over stream chunks (text_offset runs on)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset  # characters of the choice's text before the next token

    def chunk(self, token_ids: Sequence[int], rows: Sequence[dict[int, Logprob] | None], text_of) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for tid, row in zip(token_ids, rows):
            if row is None:  # the first prompt token: no context, no logprob
                text, value, top = text_of[tid], None, None
            else:
                entry = row[tid]
                text, value = entry.decoded_token, clamp(entry.logprob)
                top = {e.decoded_token: clamp(e.logprob) for e in row.values()}
            tokens.append(text)
            values.append(value)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], rows: Sequence[dict[int, Logprob]], num_top: int,
                  requested: list[int] | None) -> dict:
    """{content: [...]} for generated tokens: top_logprobs in rank order (or
    the requested logprob_token_ids, in their order)."""
    content = []
    for tid, row in zip(token_ids, rows):
        entry = row[tid]
        if requested is not None:
            top = [row[t] for t in requested]
        else:
            top = sorted((e for e in row.values() if e.rank is not None and e.rank <= num_top), key=_rank)
        content.append({"token": entry.decoded_token, "logprob": clamp(entry.logprob),
                        "bytes": list(entry.decoded_token.encode()),
                        "top_logprobs": [{"token": e.decoded_token, "logprob": clamp(e.logprob),
                                          "bytes": list(e.decoded_token.encode())} for e in top]})
    return {"content": content}


def _rank(e: Logprob) -> int:
    return e.rank


def prompt_logprobs_json(rows) -> list | None:
    """vLLM's prompt_logprobs field: per prompt position None or {id: {logprob, rank, decoded_token}}."""
    if rows is None:
        return None
    return [None if row is None else
            {str(t): {"logprob": clamp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
             for t, e in row.items()} for row in rows]


class Envelope:
    """The fields every body or chunk of one response shares."""

    def __init__(self, prefix: str, request_id: str, model: str) -> None:
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model

    def body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}
