"""LLM: the offline engine. Submit a batch of prompts, get their completions.

It runs the same engine core and frontend as AsyncEngine: the core serves
on a private ipc socket from threads of this process, and an AsyncEngine on
a private event loop thread talks to it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Sequence

import msgspec
from prometheus_client import CollectorRegistry
from tqdm.auto import tqdm

from headrace.config import EngineArgs
from headrace.core.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from headrace.frontend.async_engine import AsyncEngine, Prompt, new_event_loop
from headrace.frontend.core_process import private_ipc_address, remove_private_ipc
from headrace.lifetime import heap_frozen
from headrace.metrics.exporter import MetricsServer, check_metrics_options
from headrace.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger("headrace.frontend")


class LLM:
    """LLM(model, dtype="auto", device="auto", max_num_seqs=256,
    max_num_batched_tokens=8192, max_model_len=None, block_size=16,
    num_kv_blocks=None, enable_prefix_caching=True, seed=0, tokenizer=None,
    metrics_port=None, metrics_registry=None)

    metrics_port serves the engine's and the frontend's Prometheus series
    together on 127.0.0.1:port (0 = a free port; see self.metrics_port);
    metrics_registry registers them into the application's registry instead.
    """

    def __init__(self, model: str, *, metrics_port: int | None = None, metrics_registry=None, **kwargs) -> None:
        if "data_parallel_size" in kwargs:
            raise TypeError("LLM runs one engine core in this process; for several cores use "
                            "AsyncEngine.from_model(..., data_parallel_size=N) or headrace serve --data-parallel-size N")
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {sorted(unknown)}")
        check_metrics_options(metrics_port, metrics_registry)
        args = EngineArgs(model=str(model), **kwargs)
        # The one place a frontend runs a core: in this process, so the
        # engine (and torch) load here, when an LLM is built.
        from headrace.core.server import CoreServer

        address, directory = private_ipc_address()
        try:
            self.core = CoreServer(args, address)
        except BaseException:
            os.rmdir(directory)
            raise
        self.metrics_port: int | None = None
        metrics_server = core_collector = None
        if metrics_port is not None or metrics_registry is not None:
            if metrics_registry is None:
                metrics_registry = CollectorRegistry()
            core_collector = self.core.metrics_collector()
            metrics_registry.register(core_collector)
            if metrics_port is not None:
                metrics_server = MetricsServer(metrics_registry, "127.0.0.1", metrics_port)
                self.metrics_port = metrics_server.port
        self.engine = self.core.engine  # the EngineCore, for inspection
        core_thread = threading.Thread(target=self.core.serve_forever, name="headrace-core", daemon=True)
        core_thread.start()
        self._loop = new_event_loop()
        loop_thread = threading.Thread(target=self._loop.run_forever, name="headrace-frontend", daemon=True)
        loop_thread.start()
        self._frontend = AsyncEngine(self.core.address, metrics_registry=metrics_registry)
        self._finalizer = weakref.finalize(
            self, _shutdown, self.core, core_thread, self._frontend, self._loop, loop_thread, address, directory,
            metrics_registry, core_collector, metrics_server,
        )
        try:
            self._call(self._frontend.start())
        except BaseException:
            self._finalizer()
            raise
        self.tokenizer = self._frontend.tokenizer
        self.max_model_len = self._frontend.info.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's threads, free its device memory and remove its
        socket (also done when the LLM is collected)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, coro):
        if not self._finalizer.alive:
            coro.close()
            raise RuntimeError("this LLM has been shut down; build a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        Every prompt is checked before any is submitted: one bad prompt
        raises and nothing of the batch runs.
        """
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(sp).__name__}")
        inputs = [self._frontend.tokenize(p, i, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        final = [msgspec.structs.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        with heap_frozen():  # full collections meanwhile skip torch, the model and the modules
            return self._call(self._run(inputs, final, use_tqdm))

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's LLM.beam_search): the same
        search as generate() with SamplingParams(use_beam_search=True,
        best_of=n=beam_width), run inside the engine; every beam comes back,
        best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        outs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.logprobs,
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason)
                                  for c in o.outputs]) for o in outs]

    async def _run(self, inputs, params, use_tqdm: bool) -> list[RequestOutput]:
        frontend = self._frontend
        bar = tqdm(total=len(inputs), desc="generate", unit="req", disable=not use_tqdm or len(inputs) < 2)
        submitted = []
        try:
            for (text, ids), sp in zip(inputs, params):
                submitted.append(await frontend.submit(text, ids, sp))
            results = []
            for state in submitted:
                async for out in frontend.outputs(state):  # FINAL_ONLY: one output
                    results.append(out)
                bar.update(1)
            return results
        except BaseException:
            live = [s.request_id for s in submitted if frontend.is_running(s.request_id)]
            if live and not frontend.is_dead:
                await frontend.abort(live)
            raise
        finally:
            bar.close()


def _as_list(prompts) -> list:
    """One prompt (text, token ids, chat messages, dict) or a list of prompts, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    one_token_list = prompts and all(isinstance(t, int) for t in prompts)
    one_chat = prompts and all(isinstance(m, dict) and "role" in m for m in prompts)
    return [prompts] if one_token_list or one_chat else prompts


def _shutdown(core, core_thread, frontend, loop, loop_thread, address, directory, metrics_registry=None,
              core_collector=None, metrics_server=None) -> None:
    if metrics_server is not None:
        metrics_server.close()
    if core_collector is not None:
        metrics_registry.unregister(core_collector)
    frontend._close_metrics()
    if loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(frontend.aclose(), loop).result(timeout=5)
        except Exception:
            pass
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=5)
    core.stop()
    core_thread.join(timeout=10)  # on its way out the core thread closes the engine, freeing its device memory
    if core_thread.is_alive():
        logger.warning("the engine core did not stop within 10 s; its device memory stays in use until it does")
    remove_private_ipc(address, directory)
