"""AsyncEngine: stream completions from an engine core into asyncio code."""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import msgspec
from prometheus_client import CollectorRegistry

from headrace.checkpoint.tokenizer import Tokenizer
from headrace.config import EngineArgs
from headrace.core.outputs import RequestOutput
from headrace.core.protocol import Ready, RequestError, Stats, StepOutputs
from headrace.core.request import check_prompt, truncate_prompt
from headrace.frontend.client import EngineClient, EngineDeadError, EngineRestartingError
from headrace.frontend.core_process import CoreProcess
from headrace.frontend.output_processor import RequestState, TokenText
from headrace.frontend.router import Router, check_routing
from headrace.metrics.exporter import MetricsServer, check_metrics_options, frontend_collector
from headrace.metrics.stats import FrontendStats
from headrace.sampling_params import SamplingParams, check_token_ids

try:
    import uvloop
except ImportError:  # optional: the default event loop works too
    uvloop = None

logger = logging.getLogger("headrace.frontend")

Prompt = str | list[int] | list[dict] | dict


def run(main) -> object:
    """asyncio.run under uvloop when it is installed."""
    if uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


class AsyncEngine:
    """A frontend: tokenizes, sends requests to an engine core over ZeroMQ,
    and streams RequestOutputs back.

        async with AsyncEngine.from_model("path/to/model") as engine:
            async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
                print(out.outputs[0].text)

    from_model spawns a core process that lives as long as this engine (and
    never outlives this process); connect joins a core already running.

    Data parallelism: with several cores (from_model's data_parallel_size,
    or connect with a list of addresses) each request goes to one core and
    streams from it to the end. routing="prefix" (the default) sends a
    prompt whose leading blocks this frontend sent to a core before to that
    core, so it finds them in its prefix cache, unless that core is clearly
    busier than the least loaded one; routing="least_loaded" always picks
    the core with the fewest of this frontend's requests (frontend/router.py
    states the rule). A core that dies fails its own requests; the engine
    then counts as dead (new requests raise EngineDeadError) while the
    other cores finish theirs.

    reconnect=True (connect only) is for cores that a supervisor restarts at
    the same address, as `headrace serve` does: a core's death still fails
    its requests at once, then this engine connects to the address again
    until a core serving the same model answers. Meanwhile new requests go
    to the other cores, or raise EngineRestartingError (an EngineDeadError)
    when there are none, rather than wait.

    Request-level Prometheus metrics (docs/metrics.md): metrics_port serves
    them on 127.0.0.1:port (0 = a free port; see self.metrics_port), or
    metrics_registry registers them into the application's own registry.
    """

    def __init__(self, address: str | Sequence[str], process: CoreProcess | Sequence[CoreProcess] | None = None, *,
                 metrics_port: int | None = None, metrics_registry=None, routing: str = "prefix",
                 reconnect: bool = False) -> None:
        check_metrics_options(metrics_port, metrics_registry)
        if not isinstance(reconnect, bool):
            raise TypeError(f"reconnect must be a bool, got {reconnect!r}")
        if reconnect and process is not None:
            raise ValueError("reconnect is for cores that something else restarts; this engine spawned its own")
        self._reconnect = reconnect
        self._rejoining: dict[int, asyncio.Task] = {}  # core -> the task connecting to its address again
        self._routing = check_routing(routing)
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ValueError("give at least one core address")
        self.address = self.addresses[0]
        self._processes = [] if process is None else [process] if isinstance(process, CoreProcess) else list(process)
        self._process = self._processes[0] if self._processes else None
        self.frontend_id = uuid.uuid4().hex[:12]
        self._stats: FrontendStats | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        if metrics_port is not None or metrics_registry is not None:
            self._stats = FrontendStats(self.frontend_id)
            if metrics_registry is None:
                metrics_registry = CollectorRegistry()
                self._metrics_server = MetricsServer(metrics_registry, "127.0.0.1", metrics_port)
                self.metrics_port = self._metrics_server.port
            self._metrics_collector = frontend_collector(metrics_registry)
            self._metrics_collector.add(self._stats)
        self._clients: list[EngineClient] = []  # one per core, in the order of self.addresses
        self._load: list[int] = []  # core -> this frontend's live requests on it
        self._router: Router | None = None  # made at the handshake, from each core's Ready
        self._start_lock: asyncio.Lock | None = None
        self.tokenizer = None
        self.info: Ready | None = None
        self._states: dict[str, RequestState] = {}  # live requests: not finished, not failed
        self._ids = itertools.count()
        self._token_text: TokenText | None = None
        self._output_tasks: list[asyncio.Task] = []

    @classmethod
    def from_model(cls, model: str, *, metrics_port: int | None = None, metrics_registry=None,
                   core_metrics_port: int | None = None, data_parallel_size: int = 1, routing: str = "prefix",
                   **engine_args) -> AsyncEngine:
        """Spawn data_parallel_size cores for model (on a GPU machine core i
        takes the tensor_parallel_size GPUs from i * tensor_parallel_size);
        core_metrics_port has each serve its own series on 127.0.0.1:port
        (with several cores only 0, a free port each; metrics_port is this
        frontend's); routing: how requests pick a core (see the class)."""
        check_metrics_options(metrics_port, metrics_registry)
        check_routing(routing)
        if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if data_parallel_size > 1 and core_metrics_port not in (None, 0):
            raise ValueError("several cores cannot share core_metrics_port; give 0 (a free port each) or None")
        args = EngineArgs(model=str(model), **engine_args)
        processes = []
        try:
            for i in range(data_parallel_size):
                processes.append(CoreProcess.spawn(args, metrics_port=core_metrics_port, data_parallel_rank=i))
            return cls([p.address for p in processes], processes, metrics_port=metrics_port,
                       metrics_registry=metrics_registry, routing=routing)
        except BaseException:
            for p in processes:
                p.shutdown()
            raise

    @classmethod
    def connect(cls, address: str | Sequence[str], *, metrics_port: int | None = None,
                metrics_registry=None, routing: str = "prefix", reconnect: bool = False) -> AsyncEngine:
        """Join running cores: one address, or several (data parallel);
        reconnect: wait for a dead core's restart (see the class)."""
        return cls(address, metrics_port=metrics_port, metrics_registry=metrics_registry, routing=routing,
                   reconnect=reconnect)

    async def __aenter__(self) -> AsyncEngine:
        try:
            await self.start()
        except BaseException:
            await self.aclose()  # the cores this engine spawned, the others among them
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> Ready:
        """Connect and handshake (generate() does this on first use)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._clients:
                clients = []
                try:
                    for i, address in enumerate(self.addresses):
                        alive = self._processes[i].alive if self._processes else None
                        clients.append(EngineClient(address, alive))
                        info = await clients[-1].start()
                        if self.info is not None and _serves(info) != _serves(self.info):
                            raise ValueError(f"the core at {address} serves {_serves(info)}, the core at "
                                             f"{self.addresses[0]} {_serves(self.info)}; data-parallel cores must match")
                        self.info = self.info or info
                    self.tokenizer = await asyncio.to_thread(Tokenizer.from_prepared, self.info.tokenizer_json,
                                                             self.info.tokenizer_meta, self.info.tokenizer)
                    self._token_text = await asyncio.to_thread(TokenText, self.tokenizer, self.info.vocab_size)
                except BaseException as e:
                    for client in clients:
                        await client.close()
                    self.info = None
                    reason = self._processes[len(clients) - 1].startup_failure() if self._processes and clients \
                        else None
                    if isinstance(e, EngineDeadError) and reason:
                        raise EngineDeadError(f"the engine core for {self.addresses[len(clients) - 1]} failed to "
                                              f"start: {reason}") from None
                    raise
                if self._stats is not None:
                    with self._stats.lock:
                        self._stats.model_name = self.info.model
                self._clients, self._load = clients, [0] * len(clients)
                self._router = Router([c.ready.block_size for c in clients], [c.ready.num_kv_blocks for c in clients],
                                      self._routing)
                loop = asyncio.get_running_loop()
                self._output_tasks = [loop.create_task(self._receive_outputs(i)) for i in range(len(clients))]
        return self.info

    @property
    def frontend_stats(self) -> FrontendStats | None:
        """This frontend's request-level stats (None without metrics_port or metrics_registry)."""
        return self._stats

    @property
    def token_text(self):
        """Token id -> that token's text alone (the table logprob entries use)."""
        return self._token_text.of

    @property
    def is_dead(self) -> bool:
        """Whether a core of this engine has died (and, with reconnect, is not back yet)."""
        return any(c.dead is not None for c in self._clients)

    @property
    def num_live_requests(self) -> int:
        """Requests submitted and not yet finished, failed or aborted."""
        return len(self._states)

    def fail_all(self, err: BaseException) -> int:
        """Fail every live request with err and abort it in its core (a server that stops
        waiting for them); returns how many there were."""
        failed = self._fail(err)
        for core, client in enumerate(self._clients):
            ids = [s.request_id for s in failed if s.core == core]
            if ids and client.dead is None:
                client.abort(ids)
        return len(failed)

    @property
    def is_restarting(self) -> bool:
        """Whether this engine (made with reconnect) waits for a dead core to come back."""
        return bool(self._rejoining)

    @property
    def num_live_cores(self) -> int:
        return sum(c.dead is None for c in self._clients)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request, as sampling_params.output_kind says.

        A consumer slower than the engine gets merged outputs: one DELTA with
        everything since its last, or the latest CUMULATIVE state. Breaking
        out of the loop or cancelling the consuming task aborts the request
        in the core.
        """
        state = await self.add_request(prompt, sampling_params, request_id)
        async for out in self.outputs(state):
            yield out

    async def outputs(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of a submitted request (see generate)."""
        try:
            while True:
                out = state.output()
                if out is not None:
                    yield out
                    if out.finished:
                        return
                elif state.error is not None:
                    raise state.error
                else:
                    await state.wait()
        finally:
            if self._states.get(state.request_id) is state:
                self._forget(state)
                state.abort()
                client = self._clients[state.core]
                if client.dead is None:
                    client.abort([state.request_id])

    async def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestState:
        """Submit one request; returns its state (stream it with outputs())."""
        await self.start()
        text, token_ids = self.tokenize(prompt, params=sampling_params)
        return await self.submit(text, token_ids, sampling_params, request_id)

    async def submit(self, text: str | None, token_ids: list[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> RequestState:
        """Submit an already tokenized and validated prompt (truncated as the params say, if not yet)."""
        self._check_alive(any_core=self._reconnect)  # reconnecting, the live cores take what comes meanwhile
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = self._resolve_params(params)
        token_ids = truncate_prompt(token_ids, params, self.info.max_model_len)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        state = RequestState(request_id, text, token_ids, params, self.tokenizer, self._token_text, arrival)
        state.stats = self._stats
        state.core = self._router.choose(token_ids, self._load, [c.dead is None for c in self._clients])
        self._clients[state.core].add(request_id, token_ids, params, arrival)
        self._states[request_id] = state
        self._load[state.core] += 1
        return state

    def _forget(self, state: RequestState) -> None:
        """Drop a live request from this frontend's books (its core's load included)."""
        del self._states[state.request_id]
        self._load[state.core] -= 1

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids against the vocabulary and tokenize bad_words."""
        check_token_ids(params, self.info.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            seqs = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):  # as a word of its own and inside text
                    ids = self.tokenizer.encode(variant, add_special_tokens=False)
                    if ids and ids not in seqs:
                        seqs.append(ids)
            params = msgspec.structs.replace(params, bad_words_token_ids=seqs)
        return params

    def tokenize(self, prompt: Prompt, index: int | None = None,
                 params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a string, token-id list, chat messages or
        {"prompt" | "prompt_token_ids": ...}; truncated as params.truncate_prompt_tokens
        says, then validated against the model. The text stays the one given."""
        name = "prompt" if index is None else f"prompt {index}"
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"{name}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        text = None
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"{name} must be a string, a list of token ids or a list of chat messages")
        if isinstance(params, SamplingParams):  # another type is refused when the request is submitted
            token_ids = truncate_prompt(token_ids, params, self.info.max_model_len)
        check_prompt(token_ids, self.info.max_model_len, self.info.vocab_size, name)
        return text, token_ids

    def is_running(self, request_id: str) -> bool:
        """Whether this frontend has the request and it has not finished."""
        return request_id in self._states

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort running requests; an id this frontend does not know raises KeyError."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        unknown = [r for r in ids if r not in self._states]
        if unknown:
            raise KeyError(f"unknown request ids: {unknown}")
        self._check_alive()
        for rid in ids:
            state = self._states[rid]
            self._clients[state.core].abort([rid])
            self._forget(state)
            state.abort()

    async def stats(self):
        """The core's counters (requests, KV blocks, slots); with several cores, their sums."""
        await self.start()
        self._check_alive()
        every = await asyncio.gather(*(c.stats() for c in self._clients))
        if len(every) == 1:
            return every[0]
        return msgspec.structs.replace(every[0], **{f: sum(getattr(s, f) for s in every)
                                                      for f in every[0].__struct_fields__})

    async def aclose(self) -> None:
        """Leave the core (stopping it, if this engine spawned it); requests still
        running fail with EngineDeadError."""
        tasks = self._output_tasks + list(self._rejoining.values())
        self._reconnect = False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._output_tasks, self._rejoining = [], {}
        if self._clients:
            for client in self._clients:
                await client.close()
            self._fail(EngineDeadError("the engine was closed"))
            self._clients = []
        await asyncio.gather(*(asyncio.to_thread(p.shutdown) for p in self._processes))
        self._close_metrics()

    def shutdown(self) -> None:
        """Stop spawned cores (from sync code; in async code use aclose())."""
        for p in self._processes:
            p.shutdown()
        self._close_metrics()

    def _close_metrics(self) -> None:
        """Stop serving metrics, and leave the application's registry."""
        if self._stats is not None:
            self._metrics_collector.remove(self._stats)
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    def _check_alive(self, any_core: bool = False) -> None:
        """Raise if a core is dead (any_core: only if every core is)."""
        dead = [core for core, client in enumerate(self._clients) if client.dead is not None]
        if not dead or any_core and len(dead) < len(self._clients):
            return
        core = dead[0]
        if core in self._rejoining:
            raise EngineRestartingError(f"the engine core at {self.addresses[core]} is restarting "
                                        f"({self._clients[core].dead})")
        raise EngineDeadError(str(self._clients[core].dead))

    # ---- the receive side: one task takes what the client's I/O thread received ----

    async def _receive_outputs(self, core: int) -> None:
        client = self._clients[core]
        while True:
            for msg in await client.receive():
                if isinstance(msg, StepOutputs):
                    await self._on_outputs(msg, client)
                elif isinstance(msg, RequestError):
                    state = self._states.get(msg.request_id)
                    if state is not None:
                        self._forget(state)
                        state.fail(ValueError(msg.message))
                elif isinstance(msg, Stats):
                    client.on_stats(msg)
                elif isinstance(msg, EngineDeadError):
                    client.fail_waiters(msg)
                    self._fail(msg, core)
                    if self._reconnect:
                        self._rejoining[core] = asyncio.get_running_loop().create_task(self._rejoin(core))
                    return

    async def _rejoin(self, core: int) -> None:
        """Connect to a dead core's address again until a core serving the same model answers."""
        address = self.addresses[core]
        await self._clients[core].close()
        while True:
            client = EngineClient(address)
            try:
                info = await client.start()
            except EngineDeadError as e:  # nothing answered for a while: keep waiting
                logger.warning("still waiting for an engine core at %s: %s", address, e)
                await client.close()
                continue
            if _serves(info) != _serves(self.info):
                await client.close()
                self._clients[core].dead = EngineDeadError(f"the core restarted at {address} serves "
                                                           f"{_serves(info)}, not {_serves(self.info)}")
                logger.error("%s", self._clients[core].dead)
                del self._rejoining[core]
                return
            break
        logger.info("engine core at %s is back (pid %d)", address, info.pid)
        self._clients[core], self._load[core] = client, 0
        self._output_tasks[core] = asyncio.get_running_loop().create_task(self._receive_outputs(core))
        del self._rejoining[core]

    async def _on_outputs(self, msg: StepOutputs, client: EngineClient | None) -> None:
        """Hand one step's outputs to their requests, yielding to the event loop
        between chunks so consumers (and the application) run meanwhile. A
        request aborted during a yield ignores the rest: its state is finished."""
        states = self._states
        pairs = [(out, state) for out in msg.outputs if (state := states.get(out.request_id)) is not None]
        aborts = []
        for start in range(0, len(pairs), _CHUNK):
            if start:
                await asyncio.sleep(0)
            for out, state in pairs[start : start + _CHUNK]:
                try:
                    state.process(out, msg.timestamp)
                except Exception as e:  # a bug must cost this request, not the stream of every other
                    logger.exception("failed to process the output of request %r", state.request_id)
                    if states.get(state.request_id) is state:
                        self._forget(state)
                        aborts.append(state.request_id)
                    state.fail(e)
                    continue
                if state.stopped_by_string:
                    aborts += state.stopped_by_string
                    state.stopped_by_string = []
                if state.finished and states.get(state.request_id) is state:
                    self._forget(state)
                    state.record_finished()
                state.notify()
        if aborts and client.dead is None:
            client.abort(aborts)

    def _fail(self, err: BaseException, core: int | None = None) -> list[RequestState]:
        """Fail the live requests of one core (None: of every core), each with its own copy of err
        (one exception object raised in many tasks would gather all their tracebacks); returns them."""
        failed = [s for s in self._states.values() if core is None or s.core == core]
        for state in failed:
            self._forget(state)
            state.fail(copy.copy(err))
        return failed


# Outputs handled between two yields to the event loop: about a millisecond of work.
_CHUNK = 64


def _serves(info: Ready) -> tuple:
    return info.model, info.vocab_size, info.max_model_len
