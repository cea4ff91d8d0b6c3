"""Per-request frontend state: detokenize, apply stop strings, build RequestOutputs.

The receive side calls RequestState.process() once per core output, which
does only what cannot wait: decoding the new tokens' text, searching it for
stop strings, and recording metrics. The RequestOutput is built when the
consumer asks for it (output()), from everything that arrived since it last
asked: a consumer slower than the core gets one merged delta (or the latest
cumulative state), never a backlog of stale ones. Logprobs stay in the
packed arrays they came in until then, and become Logprob objects only
where the user reads them (core.outputs.Logprobs).
"""
from __future__ import annotations

import asyncio
import bisect
import struct
import time

import numpy as np

from headrace.core.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from headrace.core.protocol import EngineCoreOutput, unpack_id_list
from headrace.frontend.detokenizer import IncrementalDetokenizer
from headrace.metrics.stats import FrontendStats
from headrace.sampling_params import RequestOutputKind, SamplingParams


class TokenText:
    """Token id -> its text alone (tokenizer.decode([id])), for logprobs. A
    fast tokenizer's whole table is decoded in one batched call, so no decode
    runs per logprob entry; other tokenizers decode on first use and cache.
    Ids the tokenizer does not know decode to ""."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode_batch") \
                and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            size = max(vocab_size, len(tokenizer))
            self.of = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        else:
            self.of = _DecodeCache(tokenizer)


class _DecodeCache(dict):
    def __init__(self, tokenizer) -> None:
        super().__init__()
        self._tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self._tokenizer.decode([token_id])
        return text


class _LogprobRows:
    """A sample's logprobs: the packed parts of each core output, kept as they
    came. An output's Logprobs is the parts since its first row, joined."""

    def __init__(self, ranked: bool, token_text: TokenText) -> None:
        self._ranked, self._text = ranked, token_text.of
        self._parts: list[tuple[bytes, bytes, bytes]] = []  # (ids, values, ranks) per core output
        self._starts: list[int] = []  # part -> its first row
        self.num = 0  # rows
        self.cumulative = 0.0  # sum of the sampled tokens' logprobs, in order

    def add(self, out: EngineCoreOutput) -> None:
        self._parts.append((out.logprob_token_ids, out.logprobs, out.sampled_ranks))
        self._starts.append(self.num)
        sampled = out.sampled_logprobs
        if len(sampled) == 4:  # one token: the common case
            self.cumulative += _F32.unpack(sampled)[0]
            self.num += 1
            return
        values = np.frombuffer(sampled, "<f4").tolist()
        for v in values:
            self.cumulative += v
        self.num += len(values)

    def rows(self, start: int) -> Logprobs:
        """Rows [start, every row arrived); start is where a part begins (where an output ended)."""
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._parts):
            return Logprobs(b"", b"", b"", self._ranked, self._text)
        assert self._starts[i] == start, "logprob rows are handed out by whole core outputs"
        if i == 0 and len(self._parts) > 1:  # the cumulative view: join once, keep the join
            self._parts, self._starts = [tuple(b"".join(col) for col in zip(*self._parts))], [0]
        parts = self._parts[i:]
        if len(parts) == 1:
            return Logprobs(*parts[0], self._ranked, self._text)
        return Logprobs(*(b"".join(col) for col in zip(*parts)), self._ranked, self._text)


_F32 = struct.Struct("<f")


class _Sample:
    """One of a request's n completions."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, token_text: TokenText) -> None:
        self.index = index
        self.params = params
        self._tokenizer, self._token_text = tokenizer, token_text
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._logprobs = self._new_logprobs()
        self._cumulative: float | None = None  # the core's figure (beam search, best_of), when it sends one
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_by_string = False  # the frontend ended it; the core must be told to abort
        self._stops = params.stop or []
        self._longest_stop = max(map(len, self._stops), default=0)
        self._hold = self._longest_stop - 1 if self._stops and not params.include_stop_str_in_output else 0
        self._text_end: int | None = None  # where a stop string cut the text
        self.sent_text = 0
        self.sent_tokens = 0
        self._finish_sent = False
        self.last_token_time: float | None = None  # core timestamp of the step that sent the last token

    def _new_logprobs(self) -> _LogprobRows | None:
        if self.params.num_logprobs is None:
            return None
        ranked = self.params.logprob_token_ids is None  # requested ids have no rank, top-N their place
        return _LogprobRows(ranked, self._token_text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids  # the detokenizer keeps the ids it decodes

    def process(self, out: EngineCoreOutput) -> None:
        if out.cumulative_logprob is not None:
            self._cumulative = out.cumulative_logprob
        if out.replace:  # beam search: a whole new sequence (a beam's, which the core ended itself)
            self.detok = IncrementalDetokenizer(self._tokenizer, self.params.skip_special_tokens)
            self._logprobs = self._new_logprobs()
            self.sent_text = self.sent_tokens = 0
            self._text_end = None
        if self._logprobs is not None and out.logprobs:
            self._logprobs.add(out)
        before = len(self.detok.text)
        self.detok.add(unpack_id_list(out.new_token_ids))
        if out.finish_reason is not None:
            self.detok.flush()
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self._stops and not out.replace:
            self._check_stop_strings(before)
        elif out.replace and isinstance(out.stop_reason, str):  # a beam the core ended on a stop string
            i = self.detok.text.find(out.stop_reason)
            self._text_end = i + len(out.stop_reason) if self.params.include_stop_str_in_output else i

    def _check_stop_strings(self, before: int) -> None:
        text = self.detok.text
        start = max(0, before - self._longest_stop + 1)
        hits = [(i, s) for s in self._stops if (i := text.find(s, start)) >= 0]
        if not hits:
            return
        i, s = min(hits)
        self._text_end = i + len(s) if self.params.include_stop_str_in_output else i
        self.stopped_by_string = self.finish_reason is None
        self.finish_reason, self.stop_reason = "stop", s

    def text(self) -> str:
        text = self.detok.text
        return text if self._text_end is None else text[: self._text_end]

    @property
    def logprobs(self) -> Logprobs | None:
        """Every position's logprobs so far (the cumulative view)."""
        return self._logprobs.rows(0) if self._logprobs is not None else None

    @property
    def cumulative_logprob(self) -> float | None:
        if self._cumulative is not None:
            return self._cumulative
        return self._logprobs.cumulative if self._logprobs is not None else None

    def has_news(self) -> bool:
        """Whether an output built now would show something not shown yet."""
        return len(self.token_ids) > self.sent_tokens or self.finished and not self._finish_sent

    def completion(self, kind: RequestOutputKind) -> CompletionOutput | None:
        """What to show of this sample now; None for DELTA with nothing new."""
        text = self.text()
        visible = len(text) if self.finished else max(self.sent_text, len(text) - self._hold)
        ids = self.token_ids
        lp = self._logprobs
        if kind == RequestOutputKind.DELTA:
            if visible == self.sent_text and len(ids) == self.sent_tokens \
                    and (not self.finished or self._finish_sent):
                return None
            text_out, ids_out = text[self.sent_text : visible], ids[self.sent_tokens :]
            lps_out = lp.rows(self.sent_tokens) if lp is not None else None
        else:
            text_out, ids_out = text[:visible], list(ids)
            lps_out = lp.rows(0) if lp is not None else None
        self.sent_text, self.sent_tokens, self._finish_sent = visible, len(ids), self.finished
        return CompletionOutput(
            index=self.index,
            text=text_out,
            token_ids=ids_out,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=lps_out,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """A request in the frontend, from submission until its consumer has its
    last output. process() runs on the receive side; the consumer waits with
    wait() and takes outputs with output()."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        token_text: TokenText,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        # best_of > n: best_of samples, of which the n with the highest
        # cumulative logprob are shown; beam search: the core sends its best n.
        num = params.n if params.use_beam_search else params.num_samples
        self.samples = [_Sample(i, params, tokenizer, token_text) for i in range(num)]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: Logprobs | None = None
        self.num_cached_tokens: int | None = None  # prompt tokens the core's prefix cache served
        self._token_text = token_text
        self.stopped_by_string: list[str] = []  # "id#i" (or "id") of samples a stop string ended
        self.stats: FrontendStats | None = None  # where request-level metrics go, if anywhere
        self.core = 0  # which of the frontend's cores serves it (data parallel)
        self.error: BaseException | None = None  # raised to the consumer once its outputs are taken
        self._num_unfinished = num
        self._final_sent = False
        self._waiter: asyncio.Future | None = None

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    # The first (for n = 1, the only) sample's fields.
    finish_reason = property(lambda self: self.samples[0].finish_reason)
    stop_reason = property(lambda self: self.samples[0].stop_reason)
    logprobs = property(lambda self: self.samples[0].logprobs)
    cumulative_logprob = property(lambda self: self.samples[0].cumulative_logprob)

    def final_text(self) -> str:
        return self.samples[0].text()

    def finish(self, reason: str) -> None:
        for s in self.samples:
            if not s.finished:
                s.finish_reason = reason
        self._num_unfinished = 0

    def abort(self) -> None:
        """End every unfinished sample as aborted and record the request's metrics."""
        self.finish("abort")
        self.record_finished()
        self.notify()

    def fail(self, error: BaseException) -> None:
        """End the request with an error for its consumer."""
        self.error = error
        self._num_unfinished = 0
        self.notify()

    def process(self, out: EngineCoreOutput, timestamp: float | None = None) -> None:
        """Take one core output (of the step that ended at core time timestamp)."""
        sample = self.samples[out.index]
        if sample.finished:
            return  # e.g. tokens the core produced before it saw our abort
        sample.process(out)
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
        m = self.metrics
        if self.stats is not None and timestamp:
            if sample.last_token_time is not None and out.new_token_ids:
                self.stats.on_token_gaps([timestamp - sample.last_token_time])
            sample.last_token_time = timestamp
        if self.stats is not None and m.first_token_time is None and out.first_token_time is not None:
            self.stats.on_first_token(m.arrival_time, out.first_scheduled_time, out.first_token_time)
        if out.prompt_ranks and self.prompt_logprobs is None:
            self._add_prompt_logprobs(out)
        if sample.stopped_by_string:
            sample_id = self.request_id if len(self.samples) == 1 else f"{self.request_id}#{out.index}"
            self.stopped_by_string.append(sample_id)
        m.first_scheduled_time = m.first_scheduled_time or out.first_scheduled_time
        m.first_token_time = m.first_token_time or out.first_token_time
        if sample.finished:
            self._num_unfinished -= 1
            if self._num_unfinished == 0:
                m.finished_time = out.finished_time or m.finished_time

    def record_finished(self) -> None:
        """Record the request-level metrics of a request that just finished (or was aborted)."""
        if self.stats is None:
            return
        m = self.metrics
        if m.finished_time is None:
            m.finished_time = time.time()  # ended in the frontend: a stop string or an abort
        reason = self.finish_reason or "abort"
        self.stats.on_finished(reason, m.arrival_time, m.first_token_time, m.finished_time,
                               len(self.prompt_token_ids), sum(len(s.token_ids) for s in self.samples))
        self.stats = None  # once

    def _add_prompt_logprobs(self, out: EngineCoreOutput) -> None:
        ranked = self.params.logprob_token_ids is None  # requested ids have no rank
        # The first prompt token has no context: its entry is None.
        self.prompt_logprobs = Logprobs(out.prompt_logprob_token_ids, out.prompt_logprobs, out.prompt_ranks, ranked,
                                        self._token_text.of, num_empty=1)

    # ---- the consumer's side ----

    def notify(self) -> None:
        """Wake the consumer, if it waits."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until process(), abort() or fail() has something for the consumer."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def done(self) -> bool:
        """The consumer has had the last output (or the error is all that is left)."""
        return self._final_sent or (self.error is not None and not self._has_news())

    def _has_news(self) -> bool:
        if self.kind == RequestOutputKind.FINAL_ONLY:
            return self.finished and self.error is None and not self._final_sent
        return not self._final_sent and any(s.has_news() for s in self.samples)

    def _shown(self) -> list[_Sample]:
        """The samples an output shows: all, or for best_of > n the n with the
        highest cumulative logprob so far (a stable order: ties by index)."""
        n = self.params.n
        if len(self.samples) == n:
            return self.samples
        return sorted(self.samples, key=lambda s: -(s.cumulative_logprob or 0.0))[:n]

    def output(self) -> RequestOutput | None:
        """Everything new since the last output, as output_kind says; None if nothing is."""
        if self.error is not None and self.kind == RequestOutputKind.FINAL_ONLY:
            return None
        if not self._has_news():
            return None
        finished = self.finished and self.error is None
        kind = RequestOutputKind.CUMULATIVE if self.kind == RequestOutputKind.FINAL_ONLY else self.kind
        completions = []
        ranked = len(self.samples) > self.params.n  # best_of > n: the n best, indexed by rank
        for rank, s in enumerate(self._shown()):
            c = s.completion(kind)
            if c is not None:
                c.index = rank if ranked else c.index
                completions.append(c)
        if not completions and not finished:
            return None
        self._final_sent = finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
