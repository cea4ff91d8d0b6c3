"""Tensor parallelism over processes: every rank's ModelRunner in a worker
process of its own, driven by the engine core.

    engine core (scheduler)                       worker rank r (a process running workers.main)
      TPExecutor --PUSH calls-r (ipc)-->            Init, then Execute / Collect / Remove / Close, in order
                 <--PULL replies (ipc)--            Ready; StepResult (rank 0 only); WorkerError
                                                    ModelRunner(tp=rank r) <-NCCL / gloo-> other ranks

Every rank runs the same calls on the same inputs, so the ranks' collectives
pair up and their samplers, seeded per request, pick the same tokens; rank 0
sends each step's outputs back. The core process joins no process group: a
worker that dies (or a rank stuck in a collective with a dead peer) cannot
hang it. While it waits for a reply the core checks every worker; one that
exited fails the engine with its rank and exit code, and close() kills them
all. Messages are msgspec structs; arrays travel as little-endian bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque

import msgspec
import numpy as np
import zmq

from headrace.core.config import EngineArgs, ModelConfig, SchedulerConfig
from headrace.core.scheduler import CachedRequestData, NewRequestData, SchedulerOutput


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


class WorkerError(_Msg, tag="error"):
    rank: int
    message: str


ToWorker = Init | Execute | Collect | Remove | Close
FromWorker = Ready | StepResult | WorkerError


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed; the engine cannot go on."""


class _Slots:
    """The core's view of which requests hold slots (the workers hold the slots)."""

    def __init__(self) -> None:
        self.req_to_slot: dict[str, int] = {}


class TPExecutor:
    """The executor EngineCore drives when tensor_parallel_size > 1: it has
    ModelRunner's execute / collect / remove / close, each sent to every rank."""

    def __init__(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig, args: EngineArgs) -> None:
        from headrace.executor.model_runner import resolve_device, resolve_dtype

        size = args.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="headrace-tp-")  # 0700: sockets and the process-group rendezvous
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._calls, self.procs = [], []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self.processors = list(args.logits_processors)  # the workers load them; the core only asks whether any
        self.states = _Slots()
        self.closed = False
        device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, model_cfg.checkpoint_dtype, device)  # what the ranks run in
        first_gpu = device.index or 0 if device.type == "cuda" else None  # rank r takes GPU first_gpu + r
        try:
            for rank in range(size):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"ipc://{self._dir}/calls-{rank}")
                self._calls.append(sock)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from headrace.executor.workers import main; main()", "--rank", str(rank),
                     "--size", str(size), "--dir", self._dir, "--parent-pid", str(os.getpid())],
                    stdin=subprocess.DEVNULL))
            for rank, sock in enumerate(self._calls):
                rank_args = args if first_gpu is None else dataclasses.replace(args, device=f"cuda:{first_gpu + rank}")
                sock.send(self._encoder.encode(Init(model_config=model_cfg, sched_config=sched_cfg, args=rank_args)))
            ready = [self._receive(Ready) for _ in range(size)]
        except BaseException:
            self.close()
            raise
        self.num_blocks = ready[0].num_blocks  # the ranks agreed on it

    def _send_all(self, msg: _Msg) -> None:
        data = self._encoder.encode(msg)
        for sock in self._calls:
            sock.send(data, copy=False)

    def _receive(self, kind: type):
        """The next reply, checking every worker while it waits."""
        while not self._replies.poll(100):
            dead = self._exited()
            if dead:
                raise WorkerDied(dead)
        msg = self._decoder.decode(self._replies.recv())
        if isinstance(msg, WorkerError):
            # A rank whose peer died fails in its next collective: name the dead one when there is one.
            deadline = time.monotonic() + 1.0
            while not (dead := self._exited(skip=msg.rank)) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise WorkerDied(dead or f"tensor-parallel worker rank {msg.rank} failed: {msg.message}")
        assert isinstance(msg, kind), f"expected {kind.__name__} from a worker, got {type(msg).__name__}"
        return msg

    def _exited(self, skip: int | None = None) -> str | None:
        """Which worker (other than rank skip) has exited, if any."""
        for rank, p in enumerate(self.procs):
            if rank != skip and p.poll() is not None:
                return f"tensor-parallel worker rank {rank} exited with code {p.returncode}"
        return None

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine has been shut down")

    def execute(self, sched: SchedulerOutput) -> None:
        self.check_open()
        for rid in sched.finished_req_ids:
            self.states.req_to_slot.pop(rid, None)
        for new in sched.new_reqs:
            self.states.req_to_slot[new.req_id] = -1
        self._send_all(Execute(finished=sorted(sched.finished_req_ids), new=sched.new_reqs, cached=sched.cached_reqs,
                               num_scheduled=sched.num_scheduled_tokens))

    def collect(self, pending: None):
        from headrace.executor.model_runner import ModelRunnerOutput, PromptLogprobs
        from headrace.executor.sampler import SampledLogprobs

        self.check_open()
        self._send_all(Collect())
        r = self._receive(StepResult)
        logprobs = None
        if r.lp_cols:
            logprobs = SampledLogprobs(np.frombuffer(r.lp_ints, "<i4").reshape(-1, r.lp_cols),
                                       np.frombuffer(r.lp_floats, "<f4").reshape(-1, r.lp_cols))
        prompt = {p.req_id: PromptLogprobs(p.start, np.frombuffer(p.token_ids, "<i8").reshape(-1, p.cols),
                                           np.frombuffer(p.scores, "<f4").reshape(-1, p.cols),
                                           np.frombuffer(p.ranks, "<i8")) for p in r.prompt}
        return ModelRunnerOutput(r.req_ids, r.sampled, logprobs, prompt)

    def remove(self, req_ids) -> None:
        self.check_open()
        req_ids = list(req_ids)
        if req_ids:
            for rid in req_ids:
                self.states.req_to_slot.pop(rid, None)
            self._send_all(Remove(req_ids=req_ids))

    def close(self) -> None:
        """Stop every worker (killing those that do not stop within seconds) and remove the sockets."""
        if self.closed:
            return
        self.closed = True
        data = self._encoder.encode(Close())
        for sock in self._calls:
            try:
                sock.send(data, zmq.NOBLOCK)  # a dead worker's socket may not take it
            except zmq.ZMQError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # e.g. stuck in a collective with a dead peer
                p.kill()
                p.wait()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- the worker process ----


def _result(out) -> StepResult:
    r = StepResult(req_ids=out.req_ids, sampled=out.sampled_token_ids)
    if out.logprobs is not None:
        r.lp_ints, r.lp_floats, r.lp_cols = out.logprobs.ints.tobytes(), out.logprobs.floats.tobytes(), \
            out.logprobs.ints.shape[1]
    r.prompt = [PromptPart(rid, p.start, p.token_ids.shape[1], p.token_ids.astype("<i8").tobytes(),
                           p.scores.astype("<f4").tobytes(), p.ranks.astype("<i8").tobytes())
                for rid, p in out.prompt_logprobs.items()]
    return r


def _serve(rank: int, size: int, directory: str) -> None:
    from headrace.executor.model_runner import ModelRunner, resolve_device
    from headrace.executor.parallel import init_group

    ctx = zmq.Context()
    calls = ctx.socket(zmq.PULL)
    calls.connect(f"ipc://{directory}/calls-{rank}")
    replies = ctx.socket(zmq.PUSH)
    replies.connect(f"ipc://{directory}/replies")
    decoder, encoder = msgspec.msgpack.Decoder(ToWorker), msgspec.msgpack.Encoder()
    try:
        init = decoder.decode(calls.recv())
        device = resolve_device(init.args.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        tp = init_group(rank, size, f"{directory}/rendezvous", device)
        runner = ModelRunner(init.model_config, init.sched_config, init.args, tp)
        replies.send(encoder.encode(Ready(rank=rank, num_blocks=runner.num_blocks)))
        pending: deque = deque()
        while True:
            msg = decoder.decode(calls.recv())
            if isinstance(msg, Execute):
                sched = SchedulerOutput(new_reqs=msg.new, cached_reqs=msg.cached,
                                        num_scheduled_tokens=msg.num_scheduled, finished_req_ids=set(msg.finished))
                pending.append(runner.execute(sched))
            elif isinstance(msg, Collect):
                out = runner.collect(pending.popleft())
                if rank == 0:
                    replies.send(encoder.encode(_result(out)))
            elif isinstance(msg, Remove):
                runner.remove(msg.req_ids)
            elif isinstance(msg, Close):
                runner.close()
                return
    except Exception as e:
        traceback.print_exc()
        replies.send(encoder.encode(WorkerError(rank=rank, message=f"{type(e).__name__}: {e}")))
        raise SystemExit(1)
    finally:
        ctx.destroy(linger=1000)


def main() -> None:
    from headrace.lifetime import die_with_parent

    parser = argparse.ArgumentParser(description="one tensor-parallel worker of an engine core")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when workers stop
    _serve(args.rank, args.size, args.dir)


if __name__ == "__main__":
    main()
