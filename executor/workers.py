"""One tensor-parallel rank's side: the calls the engine core sends each
rank, and the Worker that runs them on the rank's ModelRunner.

Every rank runs the same calls on the same inputs, so the ranks' collectives
pair up and their samplers, seeded per request, pick the same tokens; rank 0
sends each step's outputs back. The processes and sockets that carry these
messages are the core's (core/tp.py). Messages are msgspec structs; arrays
travel as little-endian bytes.
"""
from __future__ import annotations

from collections import deque

import msgspec
import numpy as np

from headrace.checkpoint.config import ModelConfig
from headrace.config import EngineArgs, SchedulerConfig
from headrace.step import BeamCandidates, BeamFork, BeamSelect, CachedRequestData, NewRequestData, SchedulerOutput


class _Msg(msgspec.Struct, tag_field="t", kw_only=True):
    pass


class Init(_Msg, tag="init"):
    model_config: ModelConfig
    sched_config: SchedulerConfig
    args: EngineArgs


class Execute(_Msg, tag="exec"):
    finished: list[str]
    new: list[NewRequestData]
    cached: list[CachedRequestData]
    num_scheduled: dict[str, int]  # request id -> tokens, in batch order
    beam_forks: list[BeamFork] = []
    beam_selects: list[BeamSelect] = []


class Collect(_Msg, tag="collect"):
    pass


class Remove(_Msg, tag="remove"):
    req_ids: list[str]


class Close(_Msg, tag="close"):
    pass


class Ready(_Msg, tag="ready"):
    rank: int
    num_blocks: int


class PromptPart(msgspec.Struct, array_like=True):
    req_id: str
    start: int
    cols: int
    token_ids: bytes  # int64 [m, cols]
    scores: bytes  # float32 [m, cols]
    ranks: bytes  # int64 [m]


class StepResult(_Msg, tag="result"):
    req_ids: list[str]
    sampled: list[int]
    lp_ints: bytes = b""  # int32 [rows, lp_cols]
    lp_floats: bytes = b""  # float32 [rows, lp_cols]
    lp_cols: int = 0  # 0: no logprobs this step
    prompt: list[PromptPart] = []
    # beam candidates: float32 scores, int32 parents and tokens [groups, beam_k]; their logprobs (lp_cols wide)
    beam_k: int = 0
    beam_scores: bytes = b""
    beam_parents: bytes = b""
    beam_tokens: bytes = b""
    beam_lp_ints: bytes = b""
    beam_lp_floats: bytes = b""


class WorkerError(_Msg, tag="error"):
    rank: int
    message: str


ToWorker = Init | Execute | Collect | Remove | Close
FromWorker = Ready | StepResult | WorkerError


class Worker:
    """One rank: its ModelRunner (on GPU first + rank, or the CPU) and the steps it has queued."""

    def __init__(self, init: Init, rank: int, size: int, rendezvous: str) -> None:
        from headrace.executor.all_reduce import PEER_MAX_BYTES
        from headrace.executor.model_runner import ModelRunner, resolve_device, resolve_dtype
        from headrace.executor.parallel import init_group

        args = init.args
        device = resolve_device(args.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)  # NCCL and symmetric memory set up on the current device
        dtype = resolve_dtype(args.dtype, init.model_config.checkpoint_dtype, device)
        peer_bytes = 0 if args.disable_custom_all_reduce else PEER_MAX_BYTES
        self.rank = rank
        self.runner = ModelRunner(init.model_config, init.sched_config, args,
                                  init_group(rank, size, rendezvous, device, dtype, peer_bytes))
        self.pending: deque = deque()  # steps queued on the device, oldest first

    def ready(self) -> Ready:
        return Ready(rank=self.rank, num_blocks=self.runner.num_blocks)

    def handle(self, msg: _Msg) -> StepResult | None:
        """Run one call; returns what goes back to the core (rank 0's step outputs), if anything."""
        runner = self.runner
        if isinstance(msg, Execute):
            sched = SchedulerOutput(new_reqs=msg.new, cached_reqs=msg.cached, num_scheduled_tokens=msg.num_scheduled,
                                    finished_req_ids=set(msg.finished), beam_forks=msg.beam_forks,
                                    beam_selects=msg.beam_selects)
            self.pending.append(runner.execute(sched))
        elif isinstance(msg, Collect):
            out = runner.collect(self.pending.popleft())
            if self.rank == 0:
                return pack_result(out)
        elif isinstance(msg, Remove):
            runner.remove(msg.req_ids)
        elif isinstance(msg, Close):
            runner.close()
        return None


def pack_result(out) -> StepResult:
    """A ModelRunnerOutput as the message rank 0 sends."""
    r = StepResult(req_ids=out.req_ids, sampled=out.sampled_token_ids)
    if out.logprobs is not None:
        r.lp_ints, r.lp_floats, r.lp_cols = out.logprobs.ints.tobytes(), out.logprobs.floats.tobytes(), \
            out.logprobs.ints.shape[1]
    b = out.beams
    if b is not None:
        r.beam_k, r.beam_scores, r.beam_parents, r.beam_tokens = b.scores.shape[1], b.scores.astype("<f4").tobytes(), \
            b.parents.astype("<i4").tobytes(), b.tokens.astype("<i4").tobytes()
        if b.logprobs is not None:
            r.beam_lp_ints, r.beam_lp_floats = b.logprobs.ints.tobytes(), b.logprobs.floats.tobytes()
    r.prompt = [PromptPart(rid, p.start, p.token_ids.shape[1], p.token_ids.astype("<i8").tobytes(),
                           p.scores.astype("<f4").tobytes(), p.ranks.astype("<i8").tobytes())
                for rid, p in out.prompt_logprobs.items()]
    return r


def unpack_result(r: StepResult):
    """The ModelRunnerOutput rank 0 sent."""
    from headrace.executor.model_runner import ModelRunnerOutput, PromptLogprobs
    from headrace.executor.sampler import SampledLogprobs

    logprobs = None
    if r.lp_cols:
        logprobs = SampledLogprobs(np.frombuffer(r.lp_ints, "<i4").reshape(-1, r.lp_cols),
                                   np.frombuffer(r.lp_floats, "<f4").reshape(-1, r.lp_cols))
    prompt = {p.req_id: PromptLogprobs(p.start, np.frombuffer(p.token_ids, "<i8").reshape(-1, p.cols),
                                       np.frombuffer(p.scores, "<f4").reshape(-1, p.cols),
                                       np.frombuffer(p.ranks, "<i8")) for p in r.prompt}
    beams = None
    if r.beam_k:
        shape = (-1, r.beam_k)
        beam_lp = None
        if r.beam_lp_ints:
            cols = len(r.beam_lp_ints) // 4 // (len(r.beam_tokens) // 4)
            beam_lp = SampledLogprobs(np.frombuffer(r.beam_lp_ints, "<i4").reshape(-1, cols),
                                      np.frombuffer(r.beam_lp_floats, "<f4").reshape(-1, cols))
        beams = BeamCandidates(np.frombuffer(r.beam_scores, "<f4").reshape(shape),
                               np.frombuffer(r.beam_parents, "<i4").reshape(shape),
                               np.frombuffer(r.beam_tokens, "<i4").reshape(shape), beam_lp)
    return ModelRunnerOutput(r.req_ids, r.sampled, logprobs, prompt, beams)
