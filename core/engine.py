"""The engine core: admit and abort, schedule, execute, report."""
from __future__ import annotations

import dataclasses
import random
import time
from collections import deque

import numpy as np

from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.paths import resolve_model_path
from headrace.config import CacheConfig, EngineArgs, SchedulerConfig
from headrace.core.beam import BeamGroup
from headrace.core.protocol import EngineCoreOutput, pack_floats, pack_ids
from headrace.core.request import Request, check_prompt
from headrace.core.scheduler import Scheduler
from headrace.core.tp import TPExecutor
from headrace.executor.model_runner import ModelRunner, first_gpu, resolve_device
from headrace.executor.parallel import check_shardable
from headrace.metrics.stats import EngineStats, Laps
from headrace.sampling_params import RequestOutputKind, SamplingParams, check_token_ids


class EngineCore:
    """data_parallel_rank: this core's place among data-parallel cores; on
    GPUs it takes the tensor_parallel_size GPUs from data_parallel_rank *
    tensor_parallel_size on, counted from the GPU args.device names."""

    def __init__(self, args: EngineArgs, data_parallel_rank: int = 0) -> None:
        self.startup = Laps()  # seconds of each phase of the start (the core server adds its own and logs them)
        args = _place(args, data_parallel_rank)
        self.model_config = ModelConfig.from_dir(resolve_model_path(args.model))
        max_model_len = args.resolve_max_model_len(self.model_config)
        self.sched_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        if args.tensor_parallel_size > 1:
            check_shardable(self.model_config, args.tensor_parallel_size)
            self.startup.lap("config")
            self.executor = TPExecutor(self.model_config, self.sched_config, args)
            self.startup.lap("tensor-parallel ranks")
        else:
            self.startup.lap("config")
            self.executor = ModelRunner(self.model_config, self.sched_config, args, lap=self.startup.lap)
        try:
            self.cache_config = CacheConfig(args.block_size, self.executor.num_blocks, args.enable_prefix_caching)
            self.scheduler = Scheduler(self.sched_config, self.cache_config)
        except BaseException:
            self.executor.close()  # its memory, or its worker processes
            raise
        self._rng = random.Random(args.seed)  # seeds for requests that bring none
        self._families: dict[str, list[str]] = {}  # request id -> its live samples' scheduler ids
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time spent inside step()
        self.metrics = EngineStats()  # read by the metrics exporter's thread, under its lock
        self._iteration = (0, 0, 0)  # the last step's (scheduled, prompt, generated) tokens
        # Steps queued on the device whose outputs are not read yet, oldest
        # first: (what was scheduled, the executor's handle).
        self._in_flight: deque = deque()
        self.async_scheduling = args.async_scheduling  # read every step
        quant = self.executor.quant
        self.quantization = quant.describe() if quant is not None else "none"  # of the weights, for logs and /metrics
        # The prepared tokenizer's files (set by the core server), loaded on
        # first need: beam search checks its candidates for stop strings here.
        self.tokenizer_source: tuple[str, str] | None = None
        self._tokenizer = None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._in_flight)

    def close(self) -> None:
        """Release the executor's device memory; the engine refuses work
        afterwards (its owner, the core server, calls this on its way out).
        Closing twice is harmless."""
        self._in_flight.clear()  # steps never read back: their host copies and events
        self.executor.close()

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float
    ) -> None:
        """Admit a request; raises ValueError, changing nothing, for one the core cannot serve."""
        self.executor.check_open()
        vocab = self.model_config.vocab_size
        check_prompt(prompt_token_ids, self.sched_config.max_model_len, vocab, f"request {request_id!r}: the prompt")
        sp = sampling_params
        check_token_ids(sp, vocab)
        if request_id in self._families:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(64)
        eos = self.model_config.eos_token_ids
        if sp.use_beam_search:
            self._add_beam_group(request_id, prompt_token_ids, sp, arrival_time)
            return
        if sp.num_samples == 1:
            self.scheduler.add_request(Request(request_id, prompt_token_ids, sp, eos, seed, arrival_time))
            self._families[request_id] = [request_id]
            self.record_stats()
            return
        # n samples of one prompt: sibling requests with their own seeds; the
        # first computes the prompt, the others share its KV blocks. Their ids
        # ("id#i") are checked before any is added, so a clash with a live
        # request's id changes nothing.
        clash = [f"{request_id}#{i}" for i in range(sp.num_samples) if f"{request_id}#{i}" in self.scheduler.requests]
        if clash:
            raise ValueError(f"request {request_id!r}: its samples would be addressed as {clash[0]!r}, "
                             f"the id of a live request; use another request id")
        children, leader = [], None
        for i in range(sp.num_samples):
            child = Request(f"{request_id}#{i}", prompt_token_ids, sp, eos, _child_seed(seed, i), arrival_time,
                            leader=leader)
            child.parent_id, child.index = request_id, i
            leader = leader or child
            self.scheduler.add_request(child)
            children.append(child.request_id)
        self._families[request_id] = children
        self.record_stats()

    def _add_beam_group(self, request_id: str, prompt_token_ids: list[int], sp: SamplingParams,
                        arrival_time: float) -> None:
        width, sched, bs = sp.num_samples, self.sched_config, self.cache_config.block_size
        name = f"request {request_id!r}: beam search with best_of={width}"
        if self.executor.processors:
            raise ValueError(f"{name}: beam search does not run with the engine's custom logits processors")
        if width > sched.max_num_seqs or width > sched.max_num_batched_tokens:
            raise ValueError(f"{name} runs {width} beams in every step, but max_num_seqs={sched.max_num_seqs} and "
                             f"max_num_batched_tokens={sched.max_num_batched_tokens}")
        tokenizer = None
        if sp.stop:
            if self.tokenizer_source is None:
                raise ValueError(f"{name}: stop strings need the tokenizer, which this engine was not given")
            if self._tokenizer is None:
                from headrace.checkpoint.tokenizer import Tokenizer

                self._tokenizer = Tokenizer.from_prepared(*self.tokenizer_source)
            tokenizer = self._tokenizer
        group = BeamGroup(request_id, prompt_token_ids, sp, self.model_config.eos_token_ids, arrival_time,
                          sched.max_model_len, tokenizer)
        # The prompt's blocks once, each beam's generated blocks and a partial one of its own.
        need = -(-len(prompt_token_ids) // bs) + width * (-(-group.max_generated // bs) + 1)
        if need > self.cache_config.num_blocks:
            raise ValueError(f"{name} may need {need} KV blocks of {bs} tokens; the pool has "
                             f"{self.cache_config.num_blocks}: lower best_of or max_tokens")
        self.scheduler.add_request(group.home)
        self._families[request_id] = [b.request_id for b in group.beams]
        self.record_stats()

    @staticmethod
    def _gather_prompt_logprobs(req, plp) -> None:
        """Keep the positions not gathered before (a preempted request recomputes its prompt)."""
        skip = req.num_prompt_logprobs - plp.start
        if req.prompt_logprobs_sent or skip >= len(plp.ranks):
            return
        if skip > 0:
            plp.token_ids, plp.scores, plp.ranks = plp.token_ids[skip:], plp.scores[skip:], plp.ranks[skip:]
        req.prompt_logprobs.append(plp)
        req.num_prompt_logprobs += len(plp.ranks)

    def live(self, request_id: str) -> bool:
        """Whether a request given to add_request still has unfinished samples."""
        return request_id in self._families

    def abort(self, request_ids) -> list[str]:
        """Abort requests (all their samples) or single samples ("id#i");
        returns the ids given that were live."""
        self.executor.check_open()
        aborted = []
        for rid in request_ids:
            children = self._families.get(rid, [rid])
            if self.scheduler.abort(children):
                aborted.append(rid)
            self._settle(rid)
        self.executor.remove(self.scheduler.take_left())
        self.record_stats()
        return aborted

    def _settle(self, rid: str) -> None:
        """Forget a request once none of its samples is live."""
        parent = rid.rpartition("#")[0] if rid not in self._families else rid
        children = self._families.get(parent)
        if children is not None and not any(c in self.scheduler.requests for c in children):
            del self._families[parent]

    def step(self) -> list[EngineCoreOutput]:
        self.executor.check_open()
        start = time.perf_counter()
        self._iteration = (0, 0, 0)
        try:
            return self._step()
        finally:
            elapsed = time.perf_counter() - start
            self.num_steps += 1
            self.step_seconds += elapsed
            self.record_stats(elapsed)

    def record_stats(self, step_seconds: float | None = None) -> None:
        """Copy the gauges and counters into self.metrics, plus the last step's figures when given."""
        sched, kv, m = self.scheduler, self.scheduler.kv, self.metrics
        num_scheduled, num_prompt, num_generated = self._iteration
        with m.lock:
            m.num_running, m.num_waiting, m.kv_cache_usage = len(sched.running), len(sched.waiting), kv.usage
            m.prefix_cache_queries, m.prefix_cache_hits = kv.num_queries, kv.num_hits
            m.num_preemptions = sched.num_preemptions
            if step_seconds is not None and num_scheduled:
                m.prompt_tokens += num_prompt
                m.generation_tokens += num_generated
                m.iteration_tokens.observe(num_scheduled)
                m.step_seconds.observe(step_seconds)

    def _step(self) -> list[EngineCoreOutput]:
        """Schedule and queue step N+1, then read back step N: the device runs
        N+1 while the host processes N's outputs. Steps that need the previous
        tokens on the host (bad words, custom logits processors) run one at a
        time instead, as does every step with async_scheduling=False."""
        sync = not self.async_scheduling or bool(self.executor.processors) or bool(self.scheduler.host_token_ids)
        outputs = self._read_back(keep=0) if sync else []
        sched = self.scheduler.schedule()
        if sched.num_scheduled_tokens:
            self._in_flight.append((sched, self.executor.execute(sched)))
        else:
            self.executor.remove(sched.finished_req_ids)  # e.g. a request that preempted itself
            # Admission always fits one request into an empty pool, so an idle
            # step with nothing queued and work waiting would be a scheduler bug.
            assert self._in_flight or not self.scheduler.num_unfinished, \
                "the scheduler scheduled nothing while requests wait"
        keep = 1 if sched.num_scheduled_tokens and not sync else 0
        return outputs + self._read_back(keep)

    def _read_back(self, keep: int) -> list[EngineCoreOutput]:
        """Process the outputs of queued steps, oldest first, until `keep` are left."""
        outputs = []
        while len(self._in_flight) > keep:
            sched, pending = self._in_flight.popleft()
            outputs += self._process(sched, self.executor.collect(pending))
        return outputs

    def _process(self, sched, result) -> list[EngineCoreOutput]:
        for req_id, plp in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(req_id)
            if req is not None:
                self._gather_prompt_logprobs(req, plp)
        updates = self.scheduler.update(sched, result.sampled_token_ids, result.beams)
        # A sequence's prompt counts once, with its first token (not again when recomputed after preemption).
        first = [u for u in updates if (u.group.num_generated == 1 if u.group is not None
                                        else len(u.req.output_token_ids) == len(u.new_token_ids))]
        self._iteration = (
            sched.total_num_scheduled_tokens,
            sum(u.req.num_prompt_tokens for u in first),
            sum(len(u.new_token_ids) if u.group is None else u.group.width for u in updates),
        )
        self.executor.remove(self.scheduler.take_left())
        lp = result.logprobs
        outputs = []
        for u in updates:
            req = u.req
            if u.group is not None:
                outputs += self._beam_outputs(u)
                if u.finish_reason is not None:
                    self._settle(req.request_id)
                continue
            out = EngineCoreOutput(
                request_id=req.parent_id or req.request_id,
                index=req.index,
                new_token_ids=pack_ids(u.new_token_ids),
                finish_reason=u.finish_reason,
                stop_reason=u.stop_reason,
                num_cached_tokens=req.num_cached_tokens,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
            )
            sp = req.sampling_params
            if lp is not None and sp.num_logprobs is not None:
                out.logprob_token_ids, out.logprobs, out.sampled_ranks, out.sampled_logprobs = lp.wire(
                    u.row, 1 + sp.num_logprobs)
            if sp.num_samples > sp.n:  # best_of: the frontend returns the n most likely samples
                req.cumulative_logprob += lp.sampled_logprob(u.row)
                out.cumulative_logprob = req.cumulative_logprob
            self._attach_prompt_logprobs(req, out)
            outputs.append(out)
            if u.finish_reason is not None:
                self._settle(req.request_id)
        return outputs

    @staticmethod
    def _attach_prompt_logprobs(req, out: EngineCoreOutput) -> None:
        if req.prompt_logprobs and not req.prompt_logprobs_sent:
            out.prompt_logprob_token_ids = pack_ids(np.concatenate([p.token_ids for p in req.prompt_logprobs]))
            out.prompt_logprobs = pack_floats(np.concatenate([p.scores for p in req.prompt_logprobs]))
            out.prompt_ranks = pack_ids(np.concatenate([p.ranks for p in req.prompt_logprobs]))
            req.prompt_logprobs, req.prompt_logprobs_sent = [], True

    def _beam_outputs(self, u) -> list[EngineCoreOutput]:
        """A beam group's current best n (every step for CUMULATIVE, at its end
        for FINAL_ONLY), each replacing what its index showed before."""
        group, home = u.group, u.req
        sp = group.params
        final = u.finish_reason is not None
        if sp.output_kind == RequestOutputKind.FINAL_ONLY and not final:
            return []
        outputs = []
        for i, b in enumerate(group.best(sp.n, final)):
            out = EngineCoreOutput(
                request_id=group.request_id, index=i, new_token_ids=pack_ids(b.token_ids), replace=True,
                cumulative_logprob=b.cumulative, num_cached_tokens=home.num_cached_tokens,
                first_scheduled_time=home.first_scheduled_time, first_token_time=home.first_token_time,
                finished_time=home.finished_time)
            if final:
                out.finish_reason, out.stop_reason = b.finish_reason or "length", b.stop_reason
            if b.logprobs is not None:
                parts = list(zip(*b.logprobs))  # (ids, values, rank, sampled logprob) per position
                out.logprob_token_ids, out.logprobs, out.sampled_ranks, out.sampled_logprobs = (
                    b"".join(col) for col in parts) if parts else (b"", b"", b"", b"")
            if i == 0:
                self._attach_prompt_logprobs(home, out)
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


def _child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the samples of one request."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)


def _place(args: EngineArgs, data_parallel_rank: int) -> EngineArgs:
    """The arguments of data-parallel core data_parallel_rank (the same on the CPU)."""
    if not isinstance(data_parallel_rank, int) or isinstance(data_parallel_rank, bool) or data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be a non-negative integer, got {data_parallel_rank!r}")
    if data_parallel_rank == 0:
        return args
    device = resolve_device(args.device)
    if device.type != "cuda":
        return args
    tp = args.tensor_parallel_size
    first = first_gpu(device, data_parallel_rank * tp, tp, f"data-parallel rank {data_parallel_rank} "
                      f"(tensor_parallel_size={tp}, counting from {device})")
    return dataclasses.replace(args, device=f"cuda:{first}")
