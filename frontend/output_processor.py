"""Per-request frontend state: detokenize, apply stop strings, build RequestOutputs."""
from __future__ import annotations

import functools
import time

from headrace.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from headrace.core.protocol import EngineCoreOutput, unpack_floats, unpack_ids
from headrace.core.sampling_params import RequestOutputKind, SamplingParams
from headrace.frontend.detokenizer import IncrementalDetokenizer
from headrace.metrics.stats import FrontendStats


class TokenText:
    """decoded_token strings for logprobs, cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.of = functools.lru_cache(maxsize=1 << 16)(lambda tid: tokenizer.decode([tid]))


class _Sample:
    """One of a request's n completions."""

    def __init__(self, index: int, params: SamplingParams, tokenizer, token_text: TokenText) -> None:
        self.index = index
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        self._token_text = token_text
        wants = params.num_logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if wants else None
        self.cumulative_logprob = 0.0 if wants else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_by_string = False  # the frontend ended it; the core must be told to abort
        self._stops = params.stop or []
        self._longest_stop = max(map(len, self._stops), default=0)
        self._hold = self._longest_stop - 1 if self._stops and not params.include_stop_str_in_output else 0
        self._text_end: int | None = None  # where a stop string cut the text
        self.sent_text = 0
        self.sent_tokens = 0
        self.last_token_time: float | None = None  # core timestamp of the step that sent the last token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids  # the detokenizer keeps the ids it decodes

    def process(self, out: EngineCoreOutput) -> None:
        new_ids = unpack_ids(out.new_token_ids).tolist()
        if self.logprobs is not None and out.logprobs:
            self._add_logprobs(out, len(new_ids))
        before = len(self.detok.text)
        self.detok.add(new_ids)
        if out.finish_reason is not None:
            self.detok.flush()
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self._stops:
            self._check_stop_strings(before)

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

    def _add_logprobs(self, out: EngineCoreOutput, num_new: int) -> None:
        ids = unpack_ids(out.logprob_token_ids).reshape(num_new, -1)
        lps = unpack_floats(out.logprobs).reshape(num_new, -1)
        ranks = unpack_ids(out.sampled_ranks)
        sampled_lps = unpack_floats(out.sampled_logprobs)
        chosen = self.params.logprob_token_ids is not None  # requested ids have no rank, top-N their place
        for row in range(num_new):
            entry = {int(t): Logprob(float(v), None if chosen else r)
                     for r, (t, v) in enumerate(zip(ids[row, 1:], lps[row, 1:]), 1)}
            sampled = int(ids[row, 0])
            if sampled in entry:
                entry[sampled].rank = int(ranks[row])
            else:
                entry[sampled] = Logprob(float(lps[row, 0]), int(ranks[row]))
            for tid, lp in entry.items():
                lp.decoded_token = self._token_text.of(tid)
            self.logprobs.append(entry)
            self.cumulative_logprob += float(sampled_lps[row])

    def text(self) -> str:
        text = self.detok.text
        return text if self._text_end is None else text[: self._text_end]

    def completion(self, kind: RequestOutputKind) -> CompletionOutput | None:
        """What to show of this sample now; None for DELTA with nothing new."""
        text = self.text()
        visible = len(text) if self.finished else max(self.sent_text, len(text) - self._hold)
        if kind == RequestOutputKind.DELTA:
            text_out = text[self.sent_text : visible]
            ids_out = self.token_ids[self.sent_tokens :]
            lps_out = self.logprobs[self.sent_tokens :] if self.logprobs is not None else None
            if not text_out and not ids_out and not self.finished:
                return None
        else:
            text_out, ids_out = text[:visible], list(self.token_ids)
            lps_out = list(self.logprobs) if self.logprobs is not None else None
        self.sent_text, self.sent_tokens = visible, len(self.token_ids)
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
        self.samples = [_Sample(i, params, tokenizer, token_text) for i in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._token_text = token_text
        self.stopped_by_string: list[str] = []  # "id#i" (or "id") of samples a stop string ended
        self.stats: FrontendStats | None = None  # where request-level metrics go, if anywhere

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

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

    def abort(self) -> None:
        """End every unfinished sample as aborted and record the request's metrics."""
        self.finish("abort")
        self.record_finished()

    def process(self, out: EngineCoreOutput, timestamp: float | None = None) -> RequestOutput | None:
        """Take one core output (of the step that ended at core time timestamp);
        returns what to hand the consumer, if anything."""
        sample = self.samples[out.index]
        if sample.finished:
            return None  # e.g. tokens the core produced before it saw our abort
        sample.process(out)
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
            self.stopped_by_string.append(self.request_id if self.params.n == 1 else f"{self.request_id}#{out.index}")
        m.first_scheduled_time = m.first_scheduled_time or out.first_scheduled_time
        m.first_token_time = m.first_token_time or out.first_token_time
        if self.finished:
            m.finished_time = out.finished_time or m.finished_time
        return self.output()

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
        ranks = unpack_ids(out.prompt_ranks)
        ids = unpack_ids(out.prompt_logprob_token_ids).reshape(len(ranks), -1)
        scores = unpack_floats(out.prompt_logprobs).reshape(len(ranks), -1)
        result: list[dict[int, Logprob] | None] = [None]  # the first prompt token has no context
        chosen = self.params.logprob_token_ids is not None  # requested ids have no rank
        for row in range(len(ranks)):
            entry = {int(t): Logprob(float(v), None if chosen else r, self._token_text.of(int(t)))
                     for r, (t, v) in enumerate(zip(ids[row, 1:], scores[row, 1:]), 1)}
            target = int(ids[row, 0])
            if target in entry:
                entry[target].rank = int(ranks[row])
            else:
                entry[target] = Logprob(float(scores[row, 0]), int(ranks[row]), self._token_text.of(target))
            result.append(entry)
        self.prompt_logprobs = result

    def output(self) -> RequestOutput | None:
        finished = self.finished
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        kind = RequestOutputKind.CUMULATIVE if self.kind == RequestOutputKind.FINAL_ONLY else self.kind
        completions = [c for s in self.samples if (c := s.completion(kind)) is not None]
        if not completions and not finished:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
        )
