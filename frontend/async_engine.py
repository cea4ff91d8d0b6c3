"""AsyncEngine: stream completions from an engine core into asyncio code."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import msgspec
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from headrace import envs
from headrace.core.config import EngineArgs
from headrace.core.outputs import RequestOutput
from headrace.core.protocol import Ready, RequestError, Stats, StepOutputs
from headrace.core.request import check_prompt
from headrace.core.sampling_params import SamplingParams, check_token_ids
from headrace.executor.models import gguf
from headrace.frontend.client import EngineClient, EngineDeadError
from headrace.frontend.core_process import CoreProcess
from headrace.frontend.output_processor import RequestState, TokenText
from headrace.metrics.exporter import MetricsServer, check_metrics_options, frontend_collector
from headrace.metrics.stats import FrontendStats

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


def load_tokenizer(name: str):
    """A checkpoint's tokenizer: transformers' for a directory or hub id;
    for a .gguf file, converted from its metadata once and cached."""
    if gguf.is_gguf(name):
        return gguf.load_tokenizer(name, envs.cache_dir())
    return AutoTokenizer.from_pretrained(name)


class AsyncEngine:
    """A frontend: tokenizes, sends requests to an engine core over ZeroMQ,
    and streams RequestOutputs back.

        async with AsyncEngine.from_model("path/to/model") as engine:
            async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
                print(out.outputs[0].text)

    from_model spawns a core process that lives as long as this engine (and
    never outlives this process); connect joins a core already running.

    Request-level Prometheus metrics (docs/metrics.md): metrics_port serves
    them on 127.0.0.1:port (0 = a free port; see self.metrics_port), or
    metrics_registry registers them into the application's own registry.
    """

    def __init__(self, address: str, process: CoreProcess | None = None, *, metrics_port: int | None = None,
                 metrics_registry=None) -> None:
        check_metrics_options(metrics_port, metrics_registry)
        self.address = address
        self._process = process
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
        self._client: EngineClient | None = None
        self._start_lock: asyncio.Lock | None = None
        self.tokenizer = None
        self.info: Ready | None = None
        self._states: dict[str, RequestState] = {}  # live requests: not finished, not failed
        self._ids = itertools.count()
        self._token_text: TokenText | None = None
        self._output_task: asyncio.Task | None = None

    @classmethod
    def from_model(cls, model: str, *, metrics_port: int | None = None, metrics_registry=None,
                   core_metrics_port: int | None = None, **engine_args) -> AsyncEngine:
        """Spawn a core for model; core_metrics_port has it serve its own series
        on 127.0.0.1:port (metrics_port is this frontend's)."""
        check_metrics_options(metrics_port, metrics_registry)
        args = EngineArgs(model=str(model), **engine_args)
        process = CoreProcess.spawn(args, metrics_port=core_metrics_port)
        try:
            return cls(process.address, process, metrics_port=metrics_port, metrics_registry=metrics_registry)
        except BaseException:
            process.shutdown()
            raise

    @classmethod
    def connect(cls, address: str, *, metrics_port: int | None = None, metrics_registry=None) -> AsyncEngine:
        return cls(address, metrics_port=metrics_port, metrics_registry=metrics_registry)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def start(self) -> Ready:
        """Connect and handshake (generate() does this on first use)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._client is None:
                alive = self._process.alive if self._process is not None else None
                client = EngineClient(self.address, alive)
                self.info = await client.start()
                try:
                    self.tokenizer = await asyncio.to_thread(load_tokenizer, self.info.tokenizer)
                    self._token_text = await asyncio.to_thread(TokenText, self.tokenizer, self.info.vocab_size)
                except BaseException:
                    await client.close()
                    raise
                if self._stats is not None:
                    with self._stats.lock:
                        self._stats.model_name = self.info.model
                self._client = client
                self._output_task = asyncio.get_running_loop().create_task(self._receive_outputs())
        return self.info

    @property
    def token_text(self):
        """Token id -> that token's text alone (the table logprob entries use)."""
        return self._token_text.of

    @property
    def is_dead(self) -> bool:
        return self._client is not None and self._client.dead is not None

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
                del self._states[state.request_id]
                state.abort()
                if not self.is_dead:
                    self._client.abort([state.request_id])

    async def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestState:
        """Submit one request; returns its state (stream it with outputs())."""
        await self.start()
        text, token_ids = self.tokenize(prompt)
        return await self.submit(text, token_ids, sampling_params, request_id)

    async def submit(self, text: str | None, token_ids: list[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> RequestState:
        """Submit an already tokenized and validated prompt."""
        self._check_alive()
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = self._resolve_params(params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        state = RequestState(request_id, text, token_ids, params, self.tokenizer, self._token_text, arrival)
        state.stats = self._stats
        self._client.add(request_id, token_ids, params, arrival)
        self._states[request_id] = state
        return state

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

    def tokenize(self, prompt: Prompt, index: int | None = None) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a string, token-id list, chat messages or
        {"prompt" | "prompt_token_ids": ...}; validated against the model."""
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
        self._client.abort(ids)
        for rid in ids:
            self._states.pop(rid).abort()

    async def stats(self):
        """The core's counters (requests, KV blocks, slots)."""
        await self.start()
        self._check_alive()
        return await self._client.stats()

    async def aclose(self) -> None:
        """Leave the core (stopping it, if this engine spawned it); requests still
        running fail with EngineDeadError."""
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
            self._output_task = None
        if self._client is not None:
            await self._client.close()
            self._fail_all(EngineDeadError("the engine was closed"))
            self._client = None
        if self._process is not None:
            await asyncio.to_thread(self._process.shutdown)
        self._close_metrics()

    def shutdown(self) -> None:
        """Stop a spawned core (from sync code; in async code use aclose())."""
        if self._process is not None:
            self._process.shutdown()
        self._close_metrics()

    def _close_metrics(self) -> None:
        """Stop serving metrics, and leave the application's registry."""
        if self._stats is not None:
            self._metrics_collector.remove(self._stats)
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    def _check_alive(self) -> None:
        if self._client is not None and self._client.dead is not None:
            raise EngineDeadError(str(self._client.dead))

    # ---- the receive side: one task takes what the client's I/O thread received ----

    async def _receive_outputs(self) -> None:
        client = self._client
        while True:
            for msg in await client.receive():
                if isinstance(msg, StepOutputs):
                    await self._on_outputs(msg)
                elif isinstance(msg, RequestError):
                    state = self._states.pop(msg.request_id, None)
                    if state is not None:
                        state.fail(ValueError(msg.message))
                elif isinstance(msg, Stats):
                    client.on_stats(msg)
                elif isinstance(msg, EngineDeadError):
                    client.fail_waiters(msg)
                    self._fail_all(msg)
                    return

    async def _on_outputs(self, msg: StepOutputs) -> None:
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
                        del states[state.request_id]
                        aborts.append(state.request_id)
                    state.fail(e)
                    continue
                if state.stopped_by_string:
                    aborts += state.stopped_by_string
                    state.stopped_by_string = []
                if state.finished and states.get(state.request_id) is state:
                    del states[state.request_id]
                    state.record_finished()
                state.notify()
        if aborts and not self.is_dead:
            self._client.abort(aborts)

    def _fail_all(self, err: EngineDeadError) -> None:
        for state in self._states.values():
            state.fail(EngineDeadError(str(err)))
        self._states.clear()


# Outputs handled between two yields to the event loop: about a millisecond of work.
_CHUNK = 64
