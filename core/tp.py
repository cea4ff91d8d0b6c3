"""Tensor parallelism's processes and sockets: the core drives one worker
process per rank (executor/workers.py says what each runs).

    engine core (scheduler)                       worker rank r (a process running tp.main)
      TPExecutor --PUSH calls-r (ipc)-->            Init, then Execute / Collect / Remove / Close, in order
                 <--PULL replies (ipc)--            Ready; StepResult (rank 0 only); WorkerError
                                                    Worker: ModelRunner(rank r) <-NCCL / gloo-> other ranks

The core process joins no process group: a worker that dies (or a rank
stuck in a collective with a dead peer) cannot hang it. While it waits for a
reply the core checks every worker; one that exited fails the engine with
its rank and exit code, and close() kills them all.
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

import msgspec
import zmq

from headrace.checkpoint.config import ModelConfig
from headrace.config import EngineArgs, SchedulerConfig
from headrace.executor.all_reduce import NO_MULTICAST_ENV
from headrace.step import SchedulerOutput
from headrace.executor.workers import (Close, Collect, Execute, FromWorker, Init, Ready, Remove, StepResult, ToWorker,
                                       Worker, WorkerError, _Msg, unpack_result)
from headrace.lifetime import freeze_heap


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
        from headrace.executor.model_runner import first_gpu, resolve_device, resolve_dtype
        from headrace.executor.models.quant import resolve_quantization

        size = args.tensor_parallel_size
        device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, model_cfg.checkpoint_dtype, device)  # what the ranks run in
        # The ranks resolve the same; refused here, before any worker starts.
        self.quant = resolve_quantization(args, model_cfg, device, self.dtype, size)
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
        self._failed = False  # a worker died or failed: the others may be stuck in a collective with it
        first = None  # on GPUs rank r takes cuda:(first + r)
        if device.type == "cuda":
            first = first_gpu(device, 0, size, f"tensor_parallel_size={size} from {device}")
        try:
            for rank in range(size):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"ipc://{self._dir}/calls-{rank}")
                self._calls.append(sock)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from headrace.core.tp import main; main()", "--rank", str(rank),
                     "--size", str(size), "--dir", self._dir, "--parent-pid", str(os.getpid())],
                    stdin=subprocess.DEVNULL, env=os.environ | NO_MULTICAST_ENV))
            for rank, sock in enumerate(self._calls):
                rank_args = args if first is None else dataclasses.replace(args, device=f"cuda:{first + rank}")
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
                self._failed = True
                raise WorkerDied(dead)
        msg = self._decoder.decode(self._replies.recv())
        if isinstance(msg, WorkerError):
            # A rank whose peer died fails in its next collective: name the dead one when there is one.
            deadline = time.monotonic() + 1.0
            while not (dead := self._exited(skip=msg.rank)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._failed = True
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
                               num_scheduled=sched.num_scheduled_tokens, beam_forks=sched.beam_forks,
                               beam_selects=sched.beam_selects))

    def collect(self, pending: None):
        self.check_open()
        self._send_all(Collect())
        return unpack_result(self._receive(StepResult))

    def remove(self, req_ids) -> None:
        self.check_open()
        req_ids = list(req_ids)
        if req_ids:
            for rid in req_ids:
                self.states.req_to_slot.pop(rid, None)
            self._send_all(Remove(req_ids=req_ids))

    def close(self) -> None:
        """Stop every worker (killing those that do not stop within seconds, or
        at once after a worker failed: a GPU rank waiting on a dead peer never
        returns) and remove the sockets."""
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
                p.wait(0.5 if self._failed else 10)
            except subprocess.TimeoutExpired:  # e.g. stuck in a collective with a dead peer
                p.kill()
                p.wait()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- a worker process ----


def _serve(rank: int, size: int, directory: str) -> None:
    ctx = zmq.Context()
    calls = ctx.socket(zmq.PULL)
    calls.connect(f"ipc://{directory}/calls-{rank}")
    replies = ctx.socket(zmq.PUSH)
    replies.connect(f"ipc://{directory}/replies")
    decoder, encoder = msgspec.msgpack.Decoder(ToWorker), msgspec.msgpack.Encoder()
    try:
        worker = Worker(decoder.decode(calls.recv()), rank, size, f"{directory}/rendezvous")
        freeze_heap()  # this process serves this one rank until it exits
        replies.send(encoder.encode(worker.ready()))
        while True:
            msg = decoder.decode(calls.recv())
            reply = worker.handle(msg)
            if reply is not None:
                replies.send(encoder.encode(reply))
            if isinstance(msg, Close):
                return
    except Exception as e:
        traceback.print_exc()
        replies.send(encoder.encode(WorkerError(rank=rank, message=f"{type(e).__name__}: {e}")))
        raise SystemExit(1)
    finally:
        ctx.destroy(linger=1000)


def main() -> None:
    import logging

    from headrace import envs
    from headrace.lifetime import die_with_parent

    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    parser = argparse.ArgumentParser(description="one tensor-parallel worker of an engine core")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when workers stop
    _serve(args.rank, args.size, args.dir)
