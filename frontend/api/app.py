"""The OpenAI-compatible HTTP API over one AsyncEngine, as an ASGI app.

Each HTTP request becomes one engine request per prompt (a completion's
prompt may be a list), submitted with output_kind DELTA when streaming and
FINAL_ONLY otherwise. A client that disconnects, mid-stream or while
waiting for a whole response, has its requests aborted in the core: the
stream's generator is closed, which aborts through AsyncEngine.outputs.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from headrace.core.request import check_prompt, truncate_prompt
from headrace.frontend.api import responses as R
from headrace.sampling_params import SamplingParams
from headrace.frontend.api.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                            TokenizeRequest, decode_body, named_param)
from headrace.frontend.async_engine import AsyncEngine
from headrace.frontend.client import EngineDeadError, EngineRestartingError
from headrace.frontend.output_processor import RequestState

logger = logging.getLogger("headrace.api")

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


def json_response(body, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status, headers=headers, media_type="application/json")


def _event(body) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


class _Prompt:
    """One prompt of a request: its text (None for token ids) and token ids."""

    __slots__ = ("text", "ids")

    def __init__(self, text: str | None, ids: list[int]) -> None:
        self.text, self.ids = text, ids


class OpenAIServer:
    """Routes /v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics, /tokenize and /detokenize to one started AsyncEngine.

    metrics renders the /metrics page (the core's and every frontend's series);
    api_key, when set, is required as a bearer token on /v1/*.
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str, *,
                 metrics: Callable[[], Awaitable[bytes]] | None = None, api_key: str | None = None) -> None:
        if engine.info is None:
            raise ValueError("the engine must be started (await engine.start()) before serving it")
        self.engine = engine
        self.name = served_model_name
        self.created = int(time.time())
        self._metrics = metrics
        self._api_key = api_key
        routes = [
            Route("/v1/completions", _api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", _api(self.chat_completions), methods=["POST"]),
            Route("/v1/models", _api(self.models), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", _api(self.tokenize), methods=["POST"]),
            Route("/detokenize", _api(self.detokenize), methods=["POST"]),
        ]
        self._app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
        self._paths = {r.path for r in routes}
        self._stats = engine.frontend_stats  # where HTTP requests are counted, if anywhere
        self.draining = False  # drain() was called: new generation requests are refused with 503

    async def drain(self, timeout: float, now: asyncio.Event) -> int:
        """Refuse new generation requests (503) and wait for the running ones to finish, up to
        timeout seconds or until `now` is set; then fail the rest with a 503 that says so.
        Returns how many were cut short."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.engine.num_live_requests and not now.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        why = "a second signal" if now.is_set() else f"its shutdown timeout ({timeout:g}s)"
        err = APIError(f"the server is shutting down and stopped this request at {why}", 503,
                       type_="ServiceUnavailableError")
        return self.engine.fail_all(err)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500  # if the app fails before answering

        async def answer(msg) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            if self._api_key is not None and scope["path"].startswith("/v1/"):
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, b"Bearer " + self._api_key.encode()):
                    err = APIError("invalid or missing API key", 401, code="invalid_api_key")
                    await json_response(err.body(), 401)(scope, receive, answer)
                    return
            await self._app(scope, receive, answer)
        finally:
            if self._stats is not None:
                self._stats.on_http(scope["path"] if scope["path"] in self._paths else "other", status)

    # ---- endpoints ----

    async def completions(self, request: Request) -> Response:
        req = decode_body(await _body(request), CompletionRequest)
        self._check_model(req.model)
        params = req.params()
        add_special = req.add_special_tokens is not False
        prompts = [await self._encode(p, i, add_special, params) for i, p in enumerate(req.prompts())]
        self._check_room(prompts, params)
        env = R.Envelope("cmpl", uuid.uuid4().hex, self.name)
        states = await self._submit(prompts, params)
        if req.stream:
            return EventStream(self._completion_events(req, env, prompts, states))
        outs = await _until_done_or_gone(request, self._finals(states))
        choices = [self._completion_choice(req, p, out, c, i * params.n + c.index, first=True,
                                           logprobs=R.LegacyLogprobs() if req.wants_logprobs else None, whole=True)
                   for i, (p, out) in enumerate(zip(prompts, outs)) for c in out.outputs]
        num_generated = sum(len(c.token_ids) for out in outs for c in out.outputs)
        num_prompt = sum(len(p.ids) for p in prompts)
        cached = sum(out.num_cached_tokens or 0 for out in outs)
        return json_response(env.body("text_completion", choices, usage=R.usage(num_prompt, num_generated, cached)))

    async def chat_completions(self, request: Request) -> Response:
        req = decode_body(await _body(request), ChatCompletionRequest)
        self._check_model(req.model)
        params = req.params()
        conversation = req.conversation()
        prompt = await self._chat_prompt(conversation, req.add_generation_prompt, req.continue_final_message,
                                         req.chat_template_kwargs, req.add_special_tokens is True, params)
        self._check_room([prompt], params)
        # echo: the reply continues the last message when that has the reply's role
        prefix = conversation[-1]["content"] if req.echo and conversation[-1]["role"] == "assistant" else ""
        env = R.Envelope("chatcmpl", uuid.uuid4().hex, self.name)
        (state,) = await self._submit([prompt], params)
        if req.stream:
            return EventStream(self._chat_events(req, env, prompt, state, prefix))
        (out,) = await _until_done_or_gone(request, self._finals([state]))
        ids = req.return_token_ids
        choices = [{"index": c.index, "message": {"role": "assistant", "content": prefix + c.text},
                    "logprobs": self._chat_logprobs(req, params, c) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "token_ids": list(c.token_ids) if ids else None} for c in out.outputs]
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        usage = R.usage(len(prompt.ids), num_generated, out.num_cached_tokens or 0)
        # vLLM's fields beside OpenAI's: the prompt's logprobs and token ids, once for the whole response
        return json_response(env.body("chat.completion", choices, usage=usage,
                                      prompt_logprobs=R.prompt_logprobs_json(out.prompt_logprobs),
                                      prompt_token_ids=prompt.ids if ids else None))

    async def models(self, request: Request) -> Response:
        info = self.engine.info
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "headrace",
                "root": info.model, "max_model_len": info.max_model_len}
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        engine = self.engine
        if self.draining:
            return Response(b"the server is shutting down", 503)
        if engine.is_restarting and engine.num_live_cores:  # data parallel: the others serve meanwhile
            return Response(b"an engine core is restarting; the others serve", 200)
        if engine.is_restarting:
            return Response(b"the engine core is restarting", 503, headers=_RETRY)
        if engine.is_dead:
            return Response(b"the engine core is dead", 503)
        return Response(b"", 200)

    async def metrics(self, request: Request) -> Response:
        if self._metrics is None:
            return Response(b"metrics are not exported by this server", 404)
        return Response(await self._metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        req = decode_body(await _body(request), TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        tok = self.engine.tokenizer
        if req.prompt is not None:
            ids = await _off_loop(len(req.prompt), tok.encode, req.prompt,
                                  add_special_tokens=req.add_special_tokens is not False)
        else:
            conversation = ChatCompletionRequest(messages=req.messages).conversation()
            ids = (await self._chat_prompt(conversation, req.add_generation_prompt, req.continue_final_message,
                                           req.chat_template_kwargs, req.add_special_tokens is True, None)).ids
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": self.engine.info.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        req = decode_body(await _body(request), DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.engine.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return json_response({"prompt": self.engine.tokenizer.decode(req.tokens)})

    # ---- requests in ----

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(f"the model {model!r} does not exist; this server serves {self.name!r}", 404,
                           param="model", type_="NotFoundError", code="model_not_found")

    async def _encode(self, prompt: str | list[int], index: int, add_special: bool, params: SamplingParams) -> _Prompt:
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            ids = await _off_loop(len(text), self.engine.tokenizer.encode, text, add_special_tokens=add_special)
        else:
            ids = prompt
        return self._prompt(text, ids, "the prompt" if index == 0 else f"prompt {index}", params)

    async def _chat_prompt(self, conversation: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                           kwargs: dict | None, add_special: bool, params: SamplingParams | None) -> _Prompt:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError("the model has no chat template; use /v1/completions", param="messages")
        size = sum(len(m["content"]) for m in conversation)
        try:
            text = await _off_loop(size, tok.apply_chat_template, conversation, tokenize=False,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # the template's own checks (roles, order) raise template errors
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        ids = await _off_loop(len(text), tok.encode, text, add_special_tokens=add_special)
        return self._prompt(text, ids, "the conversation", params)

    def _prompt(self, text: str | None, ids: list[int], name: str, params: SamplingParams | None) -> _Prompt:
        """The prompt cut as params.truncate_prompt_tokens says (its text then comes from the ids kept), checked."""
        info = self.engine.info
        try:
            if params is not None:
                kept = truncate_prompt(ids, params, info.max_model_len)
                if len(kept) < len(ids):
                    text, ids = None, kept
            check_prompt(ids, info.max_model_len, info.vocab_size, name)
        except ValueError as e:
            raise APIError(str(e), param=named_param(str(e)) or "prompt") from None
        return _Prompt(text, ids)

    def _check_room(self, prompts: list[_Prompt], params: SamplingParams) -> None:
        limit = self.engine.info.max_model_len
        longest = max(len(p.ids) for p in prompts)
        if params.max_tokens is not None and longest + params.max_tokens > limit:
            raise APIError(f"this model's context is {limit} tokens, but the prompt has {longest} tokens and "
                           f"max_tokens asks for {params.max_tokens} more", param="max_tokens")

    async def _submit(self, prompts: list[_Prompt], params: SamplingParams) -> list[RequestState]:
        if self.draining:
            raise APIError("the server is shutting down", 503, type_="ServiceUnavailableError")
        base = uuid.uuid4().hex
        states: list[RequestState] = []
        try:
            for i, p in enumerate(prompts):
                states.append(await self.engine.submit(p.text, p.ids, params, f"{base}-{i}"))
        except BaseException:
            for s in states:
                await self.engine.abort(s.request_id)
            raise
        return states

    # ---- results out ----

    async def _finals(self, states: list[RequestState]) -> list:
        async def last(state: RequestState):
            out = None
            async for out in self.engine.outputs(state):
                pass
            return out

        if len(states) == 1:
            return [await last(states[0])]
        return await asyncio.gather(*map(last, states))

    async def _merged(self, states: list[RequestState]) -> AsyncIterator:
        """(prompt index, output) of every request, as they come."""
        if len(states) == 1:
            async for out in self.engine.outputs(states[0]):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, state: RequestState) -> None:
            try:
                async for out in self.engine.outputs(state):
                    queue.put_nowait((i, out, None))
            except Exception as e:
                queue.put_nowait((i, None, e))
            queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        try:
            open_ = len(tasks)
            while open_:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    open_ -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _prompt_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.engine.tokenizer.decode(p.ids)

    def _completion_choice(self, req: CompletionRequest, prompt: _Prompt, out, c, index: int, first: bool,
                           logprobs: R.LegacyLogprobs | None, whole: bool = False) -> dict:
        """A completion choice: a whole one, or what one stream chunk adds to it.
        The first (for a whole response, the only) part carries the echoed
        prompt, its logprobs, the prompt_logprobs and, with return_token_ids,
        the prompt's ids. A whole choice has vLLM's fields null when not asked
        for; a chunk leaves them out."""
        text, lp = c.text, None
        echo = first and req.echo
        if echo:
            text = self._prompt_text(prompt) + text
        if logprobs is not None:  # the prompt's first, for the text offsets to run on
            text_of = self.engine.token_text
            echoed = logprobs.chunk(prompt.ids, out.prompt_logprobs, text_of) if echo else None
            lp = _join(echoed, logprobs.chunk(c.token_ids, c.logprobs, text_of))
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        ids = req.return_token_ids
        if whole:
            choice.update(prompt_logprobs=R.prompt_logprobs_json(out.prompt_logprobs),
                          prompt_token_ids=prompt.ids if ids else None, token_ids=list(c.token_ids) if ids else None)
            return choice
        if first and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = R.prompt_logprobs_json(out.prompt_logprobs)
        if ids:
            if first:
                choice["prompt_token_ids"] = prompt.ids
            choice["token_ids"] = list(c.token_ids)
        return choice

    async def _completion_events(self, req: CompletionRequest, env: R.Envelope, prompts: list[_Prompt],
                                 states: list[RequestState]) -> AsyncIterator[bytes]:
        n = states[0].params.n
        generated: dict[int, int] = {}  # choice index -> tokens so far
        cached = [0] * len(prompts)  # prompt index -> tokens the prefix cache served
        logprobs: dict[int, R.LegacyLogprobs | None] = {}  # choice index -> its logprobs' running text offset
        async for i, out in self._merged(states):
            cached[i] = out.num_cached_tokens or 0
            events = []
            for c in out.outputs:
                index = i * n + c.index
                first = index not in logprobs
                generated[index] = generated.get(index, 0) + len(c.token_ids)
                if first:
                    logprobs[index] = R.LegacyLogprobs() if req.wants_logprobs else None
                choice = self._completion_choice(req, prompts[i], out, c, index, first, logprobs[index])
                extra = {"usage": R.usage(len(prompts[i].ids), generated[index], cached[i])} \
                    if req.continuous_usage else {}
                events.append(_event(env.body("text_completion", [choice], **extra)))
            if events:
                yield b"".join(events)
        if req.include_usage:
            usage = R.usage(sum(len(p.ids) for p in prompts), sum(generated.values()), sum(cached))
            yield _event(env.body("text_completion", [], usage=usage))

    async def _chat_events(self, req: ChatCompletionRequest, env: R.Envelope, prompt: _Prompt, state: RequestState,
                           prefix: str) -> AsyncIterator[bytes]:
        params = state.params
        num_prompt = len(prompt.ids)
        generated = [0] * params.n  # choice index -> tokens so far
        cached = 0

        def opening() -> list[bytes]:  # the role, one chunk for every choice
            extra = {"usage": R.usage(num_prompt, 0, cached)} if req.continuous_usage else {}
            if req.return_token_ids:
                extra["prompt_token_ids"] = prompt.ids
            return [_event(env.body("chat.completion.chunk", [
                {"index": j, "delta": {"role": "assistant", "content": prefix}, "logprobs": None, "finish_reason": None}
            ], **extra)) for j in range(params.n)]

        # The role first, before any token: the client sees the stream open at once. With continuous
        # usage it goes with the first output instead, whose cached count the role chunks' usage holds.
        opened = not req.continuous_usage
        if opened:
            yield b"".join(opening())
        prompt_logprobs_sent = False
        async for _, out in self._merged([state]):
            cached = out.num_cached_tokens or 0
            events = [] if opened else opening()
            opened = True
            for c in out.outputs:
                generated[c.index] += len(c.token_ids)
                lp = self._chat_logprobs(req, params, c) if req.logprobs else None
                choice = {"index": c.index, "delta": {"content": c.text} if c.text else {}, "logprobs": lp,
                          "finish_reason": c.finish_reason}
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                extra = {}
                if req.continuous_usage:
                    extra["usage"] = R.usage(num_prompt, generated[c.index], cached)
                if out.prompt_logprobs is not None and not prompt_logprobs_sent:  # once, as in a whole response
                    extra["prompt_logprobs"] = R.prompt_logprobs_json(out.prompt_logprobs)
                    prompt_logprobs_sent = True
                events.append(_event(env.body("chat.completion.chunk", [choice], **extra)))
            if events:
                yield b"".join(events)
        if req.include_usage:
            yield _event(env.body("chat.completion.chunk", [], usage=R.usage(num_prompt, sum(generated), cached)))

    def _chat_logprobs(self, req: ChatCompletionRequest, params: SamplingParams, c) -> dict:
        return R.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, params.logprob_token_ids)


class EventStream:
    """A text/event-stream response from an iterator of ready-made events.

    The iterator runs beside a watch on the connection: when the client
    disconnects the iterator is cancelled and closed at once (aborting its
    requests), whether or not an event was due. An error raised by the
    iterator reaches the client as an error event, then [DONE].
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        pump = asyncio.create_task(self._pump(send))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump, gone):
                t.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self.events.aclose()

    async def _pump(self, send) -> None:
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as e:
            await send({"type": "http.response.body", "body": _event(_error(e).body()), "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_done_or_gone(request: Request, work: Awaitable):
    """work's result, or cancel it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_disconnected(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


# Characters of prompt text above which tokenizing (or rendering a chat
# template) runs on a worker thread: a long prompt would hold the event loop,
# and every stream this server feeds, for milliseconds; a short one costs
# less than the hop to a thread.
_LONG_PROMPT = 8192


async def _off_loop(size: int, fn, *args, **kwargs):
    if size > _LONG_PROMPT:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


# The largest request body read (a prompt of a million tokens as ids is about 7 MB of JSON).
MAX_BODY_BYTES = 32 * 2**20


async def _body(request: Request) -> bytes:
    """The request's body, refused (413) past MAX_BODY_BYTES before more is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"the request body ({declared} bytes) exceeds {MAX_BODY_BYTES} bytes", 413)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the request body exceeds {MAX_BODY_BYTES} bytes", 413)
        parts.append(chunk)
    return b"".join(parts)


def _join(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


# While the engine core restarts: seconds after which a client may try again.
_RETRY = {"Retry-After": "2"}


def _error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineRestartingError):
        return APIError(str(e), 503, type_="ServiceUnavailableError", headers=_RETRY)
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine core is dead: {e}", 503, type_="ServiceUnavailableError")
    if isinstance(e, (ValueError, TypeError)):  # refused by the engine or the core: the message names the field
        return APIError(str(e), param=named_param(str(e)))
    logger.exception("internal error", exc_info=e)
    return APIError(f"internal error: {type(e).__name__}", 500, type_="InternalServerError")


def _api(handler):
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientGone:
            return Response(b"", 499)  # nobody reads it; the requests were aborted
        except Exception as e:
            err = _error(e)
            return json_response(err.body(), err.status, err.headers)

    return endpoint


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return json_response(APIError(str(exc.detail), exc.status_code, type_="NotFoundError" if exc.status_code == 404
                                  else "invalid_request_error").body(), exc.status_code)
