"""The engine core: admit and abort, schedule, execute, report."""
from __future__ import annotations

import random
import time

from headrace.core.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from headrace.core.protocol import EngineCoreOutput, pack_floats, pack_ids
from headrace.core.sampling_params import SamplingParams, check_token_ids
from headrace.core.request import Request
from headrace.core.scheduler import Scheduler
from headrace.executor.model_runner import ModelRunner
from headrace.executor.models.loader import resolve_model_path


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.model_config = ModelConfig.from_dir(resolve_model_path(args.model))
        max_model_len = args.resolve_max_model_len(self.model_config)
        self.sched_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.executor = ModelRunner(self.model_config, self.sched_config, args)
        self.cache_config = CacheConfig(args.block_size, self.executor.num_blocks, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.sched_config, self.cache_config)
        self._rng = random.Random(args.seed)  # seeds for requests that bring none
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time spent inside step()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float
    ) -> None:
        """Admit a request; raises ValueError, changing nothing, for one the core cannot serve."""
        n = len(prompt_token_ids)
        limit = self.sched_config.max_model_len
        if n == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if n >= limit:
            raise ValueError(
                f"request {request_id!r}: the prompt has {n} tokens, but max_model_len is {limit} "
                f"(at most {limit - 1} prompt tokens, leaving room to generate one)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids {bad[:5]} are outside [0, {vocab})")
        sp = sampling_params
        check_token_ids(sp, vocab)
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(64)
        self.scheduler.add_request(
            Request(request_id, prompt_token_ids, sp, self.model_config.eos_token_ids, seed, arrival_time)
        )

    def abort(self, request_ids) -> list[str]:
        aborted = self.scheduler.abort(request_ids)
        self.executor.remove(self.scheduler.take_left())
        return aborted

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start

    def _step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if not sched.num_scheduled_tokens:
            # Admission always fits one request into an empty pool, so an idle
            # step with work queued would be a scheduler bug, not a wait.
            assert not self.has_unfinished, "the scheduler scheduled nothing while requests wait"
            return []
        result = self.executor.execute(sched)
        updates = self.scheduler.update(sched, result.sampled_token_ids)
        self.executor.remove(self.scheduler.take_left())
        lp = result.logprobs
        outputs = []
        for u in updates:
            req = u.req
            out = EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=pack_ids(u.new_token_ids),
                finish_reason=u.finish_reason,
                stop_reason=u.stop_reason,
                num_cached_tokens=req.num_cached_tokens,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
            )
            if lp is not None and req.sampling_params.num_logprobs is not None:
                k = 1 + req.sampling_params.num_logprobs
                out.logprob_token_ids = pack_ids(lp.token_ids[u.row, :k])
                out.logprobs = pack_floats(lp.scores[u.row, :k])
                out.sampled_ranks = pack_ids(lp.sampled_ranks[u.row : u.row + 1])
                out.sampled_logprobs = pack_floats(lp.sampled_logprobs[u.row : u.row + 1])
            outputs.append(out)
        return outputs

    def stats(self) -> dict:
        sched = self.scheduler
        return dict(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_free_blocks=sched.kv.num_free_blocks,
            num_blocks=self.cache_config.num_blocks,
            num_slots_used=len(self.executor.states.req_to_slot),
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
        )
