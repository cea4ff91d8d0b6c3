"""LLM: the offline engine. Submit a batch of prompts, get their completions."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from headrace.core.config import EngineArgs
from headrace.core.engine import EngineCore
from headrace.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from headrace.core.protocol import EngineCoreOutput, EngineCoreRequest
from headrace.core.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """An engine in this process, for offline batches.

    LLM(model=..., dtype="auto", device="auto", max_num_seqs=256,
        max_num_batched_tokens=8192, max_model_len=None, block_size=16,
        num_kv_blocks=None, enable_prefix_caching=True, seed=0, tokenizer=None)
    """

    def __init__(self, model: str, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {sorted(unknown)}")
        self.engine = EngineCore(EngineArgs(model=str(model), **kwargs))
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or self.engine.model_config.path)
        self.max_model_len = self.engine.sched_config.max_model_len
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        Every prompt is checked before any is submitted: one bad prompt
        raises ValueError and nothing of the batch runs.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        requests = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

        states = {req.request_id: _RequestState(req, text) for req, text in requests}
        try:
            for req, _ in requests:
                self.engine.add_request(req)
            self._run(states, use_tqdm)
        except BaseException:
            self.engine.abort(list(states))
            raise
        return [states[req.request_id].output(self._decode, self._decode_token) for req, _ in requests]

    def _make_request(self, index: int, prompt: Prompt, sp: SamplingParams):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{index}] must be SamplingParams, got {type(sp).__name__}")
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"prompt {index} must be a string or a list of token ids")
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(at most {self.max_model_len - 1} prompt tokens)"
            )
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
        req = EngineCoreRequest(
            request_id=str(next(self._ids)), prompt_token_ids=token_ids, sampling_params=sp, arrival_time=time.time()
        )
        return req, text

    def _run(self, states: dict, use_tqdm: bool) -> None:
        remaining = len(states)
        bar = tqdm(total=remaining, desc="generate", unit="req", disable=not use_tqdm or remaining < 2)
        try:
            while remaining:
                for out in self.engine.step():
                    if states[out.request_id].add(out):
                        remaining -= 1
                        bar.update(1)
        finally:
            bar.close()

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class _RequestState:
    """The frontend's record of one request while it runs."""

    def __init__(self, req: EngineCoreRequest, prompt: str | None) -> None:
        self.req = req
        self.prompt = prompt
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if req.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if self.logprobs is not None else None
        self.last: EngineCoreOutput | None = None

    def add(self, out: EngineCoreOutput) -> bool:
        """Take one step's output; True when the request finished."""
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            for pos in out.new_logprobs:
                self.cumulative_logprob += pos.logprobs[0]
                entry = {}
                for rank, (tid, lp) in enumerate(zip(pos.token_ids[1:], pos.logprobs[1:]), start=1):
                    entry[tid] = Logprob(lp, rank)
                entry.setdefault(pos.token_ids[0], Logprob(pos.logprobs[0], pos.sampled_rank))
                self.logprobs.append(entry)
        self.last = out
        return out.finish_reason is not None

    def output(self, decode, decode_token) -> RequestOutput:
        out = self.last
        if self.logprobs:
            for entry in self.logprobs:
                for tid, lp in entry.items():
                    lp.decoded_token = decode_token(tid)
        completion = CompletionOutput(
            index=0,
            text=decode(self.token_ids),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=out.finish_reason if out else None,
            stop_reason=out.stop_reason if out else None,
        )
        metrics = RequestMetrics(
            arrival_time=self.req.arrival_time,
            first_scheduled_time=out.first_scheduled_time if out else None,
            first_token_time=out.first_token_time if out else None,
            finished_time=out.finished_time if out else None,
        )
        return RequestOutput(
            request_id=self.req.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.req.prompt_token_ids),
            outputs=[completion],
            finished=completion.finish_reason is not None,
            metrics=metrics,
        )
