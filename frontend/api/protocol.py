"""Request bodies of the OpenAI-compatible API, and their translation into
SamplingParams. Every field a body may carry is declared here; an unknown
field, a wrong type or a value out of range is refused with an APIError
naming the parameter (HTTP 400).
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from headrace.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code
        self.headers = headers  # of the response, e.g. Retry-After

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the whole request's usage
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries its choice's usage so far


class _Generation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What both endpoints take: OpenAI's parameters, then headrace's own."""

    model: str | None = None
    # None (JSON null) means the default, as in OpenAI's API
    n: int | None = None  # 1
    temperature: float | None = None  # 1.0
    top_p: float | None = None  # 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None  # False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # 0.0
    frequency_penalty: float | None = None  # 0.0
    logit_bias: dict[str, float] | None = None
    # headrace's own (vLLM's names), as extra body fields
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None
    act_func: str | None = None
    activation_func: str | None = None  # an alias of act_func
    logprobs_mode: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = None  # default: True for completions, False for chat (the template adds them)
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: what the context leaves)
    truncation_side: str | None = None  # which end keeps them: "left" (the last ones, the default) or "right"
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids beside the text

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
                        ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for key, value in self.logit_bias.items():
                if not re.fullmatch(r"\d+", key):
                    raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
                bias[int(key)] = value
        if self.act_func is not None and self.activation_func is not None and self.act_func != self.activation_func:
            raise APIError(f"act_func={self.act_func!r} contradicts activation_func={self.activation_func!r}",
                           param="activation_func")
        if self.stream and (self.use_beam_search or self.best_of is not None and self.best_of > _or(self.n, 1)):
            field = "use_beam_search" if self.use_beam_search else "best_of"
            raise APIError(f"stream=true cannot be used with {field}: the best sequences change as they grow; "
                           f"ask without stream", param=field)
        fields = dict(
            n=_or(self.n, 1), best_of=self.best_of, use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            # beam search does not sample: an unset temperature is 0 for it
            temperature=_or(self.temperature, 0.0 if self.use_beam_search else 1.0), top_p=_or(self.top_p, 1.0),
            top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=self.repetition_penalty, logit_bias=bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [], stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logprob_token_ids=self.logprob_token_ids,
            act_func=self.act_func or self.activation_func, logprobs_mode=self.logprobs_mode,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=_or(self.truncation_side, "left"),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise APIError(str(e), param=named_param(str(e))) from None

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """The usage so far in every chunk: continuous_usage_stats with include_usage (vLLM's meaning)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Generation, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions."""

    prompt: str | list[str | int | list[int]]  # a string, token ids, or a list of either
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # top-N per generated token, 0 to 20

    def params(self) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        # echo with logprobs scores the prompt too, as OpenAI's legacy API does
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.wants_logprobs and prompt_logprobs is None:
            prompt_logprobs = self.logprobs or 0  # with logprob_token_ids, the prompt is scored on those ids
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.logprob_token_ids is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [p]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)
        raise APIError("prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                       param="prompt")


class ChatCompletionRequest(_Generation, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # prepend the last message's content when it has the reply's role
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def params(self) -> SamplingParams:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError("max_tokens and max_completion_tokens disagree; give one", param="max_completion_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               param="top_logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(f"response_format {self.response_format.get('type')!r} is not supported (only 'text')",
                           param="response_format")
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(f"tool_choice {self.tool_choice!r} is not supported (only 'none')", param="tool_choice")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise APIError("logprob_token_ids needs logprobs=true", param="logprob_token_ids")
        # with logprob_token_ids, those ids are the top_logprobs entries
        logprobs = None if not self.logprobs else self.top_logprobs if self.logprob_token_ids is not None \
            else (self.top_logprobs or 0)
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages, checked, with text-part lists joined into strings."""
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        out = []
        for i, m in enumerate(self.messages):
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise APIError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}", param="messages")
            if isinstance(content, list):
                parts = []
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(text, str):
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise APIError(f"messages[{i}]: content part {kind!r} is not supported (only text)",
                                       param="messages")
                    parts.append(part["text"])
                content = "\n".join(parts)
            elif not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
            out.append({**m, "content": content})
        return out


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None


_ROLES = ("system", "developer", "user", "assistant")


def decode_body(body: bytes, kind: type) -> Any:
    """A request body as kind, or APIError naming the offending parameter."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
        if unknown:
            raise APIError(f"unsupported parameter {unknown.group(1)!r}", param=unknown.group(1)) from None
        missing = re.match(r"Object missing required field `([^`]+)`", text)
        if missing:
            raise APIError(f"missing required parameter {missing.group(1)!r}", param=missing.group(1)) from None
        at = re.search(r"at `\$\.?([A-Za-z_]\w*)", text)
        raise APIError(f"invalid request body: {text}", param=at.group(1) if at else None) from None
    except msgspec.DecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None


def _or(value, default):
    return default if value is None else value


_PARAMS = set(CompletionRequest.__struct_fields__) | set(ChatCompletionRequest.__struct_fields__)


def named_param(message: str) -> str | None:
    """The request parameter an error message names: its first word, when it
    is one (SamplingParams and the engine's checks start with the field)."""
    word = message.split(" ", 1)[0]
    return word if word in _PARAMS else None
