"""vLLM's server fields beside OpenAI's, through the openai client: prompt_logprobs
where vLLM puts them, token ids (return_token_ids), prompt truncation
(truncate_prompt_tokens, truncation_side), the usage's cached_tokens and
stream_options' continuous usage; against transformers on the same checkpoint."""
from __future__ import annotations

import asyncio

import openai
import pytest

from headrace import AsyncEngine, SamplingParams
from tests.conftest import hf_greedy, hf_logprobs
from tests.servers import Serve

pytestmark = pytest.mark.usefixtures("core_idle_after")  # (tests/conftest.py)

PROMPT = "The river is low today, and the boats wait at the quay for the rain to come."
CHAT = [{"role": "user", "content": "Where does the river go?"}]
BLOCK = 8  # tests/servers.py's --block-size


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3")


@pytest.fixture(scope="module")
def server(path):
    s = Serve(path)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat_ids(tok) -> list[int]:
    return tok.encode(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


class Api:
    """The served model's two generation endpoints, greedy over 6 tokens unless told."""

    def __init__(self, client) -> None:
        self.client = client
        self.name = client.models.list().data[0].id

    def completion(self, **kwargs):
        return self.client.completions.create(**{"model": self.name, "prompt": PROMPT, "max_tokens": 6,
                                                 "temperature": 0, **kwargs})

    def chat(self, **kwargs):
        return self.client.chat.completions.create(**{"model": self.name, "messages": CHAT, "max_tokens": 6,
                                                      "temperature": 0, **kwargs})


@pytest.fixture(scope="module")
def api(client):
    return Api(client)


def test_whole_responses_carry_vllms_fields_null_when_not_asked(api):
    c = api.completion().choices[0]
    assert {k: c.model_extra[k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids")} == \
        {"prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
    r = api.chat()
    assert r.model_extra["prompt_logprobs"] is None and r.model_extra["prompt_token_ids"] is None
    assert r.choices[0].model_extra["token_ids"] is None and "prompt_logprobs" not in r.choices[0].model_extra
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)


def test_completion_prompt_logprobs_come_on_each_choices_first_chunk(api, tok):
    whole = api.completion(n=2, extra_body={"prompt_logprobs": 1}).choices
    assert whole[0].model_extra["prompt_logprobs"] == whole[1].model_extra["prompt_logprobs"]
    assert len(whole[0].model_extra["prompt_logprobs"]) == len(tok.encode(PROMPT))
    chunks = list(api.completion(n=2, stream=True, extra_body={"prompt_logprobs": 1}))
    for index in (0, 1):
        mine = [ch.choices[0].model_extra for ch in chunks if ch.choices[0].index == index]
        assert mine[0]["prompt_logprobs"] == whole[index].model_extra["prompt_logprobs"]
        assert all("prompt_logprobs" not in m for m in mine[1:])
    chunks = list(api.completion(stream=True))  # not asked: no chunk carries the field
    assert all("prompt_logprobs" not in ch.choices[0].model_extra for ch in chunks)


def test_chat_prompt_logprobs_come_once_at_the_top_level(api, tok, path, hf_model):
    ids = chat_ids(tok)
    ref = hf_logprobs(hf_model(path), ids)
    r = api.chat(n=2, extra_body={"prompt_logprobs": 2})
    plp = r.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        entry = plp[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert entry["decoded_token"] == tok.decode([ids[pos]])
        assert len(plp[pos]) in (2, 3)  # the top 2, and the prompt's token when it is not among them
    assert all("prompt_logprobs" not in c.model_extra for c in r.choices)
    chunks = list(api.chat(n=2, stream=True, extra_body={"prompt_logprobs": 2}))
    carrying = [c.model_extra["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c.model_extra]
    assert carrying == [plp]


def test_return_token_ids_match_transformers(api, tok, path, hf_model):
    model = hf_model(path)
    ids = tok.encode(PROMPT)
    gen = hf_greedy(model, ids, 6)
    c = api.completion(extra_body={"return_token_ids": True}).choices[0]
    assert c.model_extra["prompt_token_ids"] == ids and c.model_extra["token_ids"] == gen
    chunks = list(api.completion(n=2, stream=True, extra_body={"return_token_ids": True}))
    for index in (0, 1):
        mine = [ch.choices[0].model_extra for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in m for m in mine[1:])
        assert sum((m["token_ids"] for m in mine), []) == gen
    ids = chat_ids(tok)
    gen = hf_greedy(model, ids, 6)
    r = api.chat(extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == ids and r.choices[0].model_extra["token_ids"] == gen
    chunks = list(api.chat(stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in ch.model_extra for ch in chunks[1:])
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks[1:]), []) == gen


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncated_prompts_generate_as_transformers_on_the_kept_tokens(api, tok, path, hf_model, side):
    model = hf_model(path)
    ids = tok.encode(PROMPT)
    kept = ids[-7:] if side == "left" else ids[:7]
    extra = {"truncate_prompt_tokens": 7, "truncation_side": side, "return_token_ids": True}
    r = api.completion(echo=True, extra_body=extra)
    c = r.choices[0]
    assert r.usage.prompt_tokens == 7 and c.model_extra["prompt_token_ids"] == kept
    gen = hf_greedy(model, kept, 6)
    assert c.model_extra["token_ids"] == gen
    assert c.text == tok.decode(kept) + tok.decode(gen, skip_special_tokens=True)  # the echo is the kept prompt
    chunks = list(api.completion(stream=True, stream_options={"include_usage": True}, extra_body=extra))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == kept and chunks[-1].usage.prompt_tokens == 7
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks[:-1]), []) == gen
    conv = chat_ids(tok)
    kept = conv[-5:] if side == "left" else conv[:5]
    r = api.chat(extra_body=extra | {"truncate_prompt_tokens": 5})
    gen = hf_greedy(model, kept, 6)
    assert r.model_extra["prompt_token_ids"] == kept and r.choices[0].model_extra["token_ids"] == gen
    chunks = list(api.chat(stream=True, extra_body=extra | {"truncate_prompt_tokens": 5}))
    assert chunks[0].model_extra["prompt_token_ids"] == kept
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[1:]) == tok.decode(gen, skip_special_tokens=True)


def test_truncation_to_what_the_context_leaves(api, tok):
    long = [11 + i % 50 for i in range(400)]  # longer than max_model_len (256)
    with pytest.raises(openai.BadRequestError) as e:
        api.completion(prompt=long, max_tokens=4)
    assert e.value.param == "prompt"
    r = api.completion(prompt=long, max_tokens=4, extra_body={"truncate_prompt_tokens": -1,
                                                                  "return_token_ids": True})
    assert r.usage.prompt_tokens == 252 and r.choices[0].model_extra["prompt_token_ids"] == long[-252:]
    assert r.usage.completion_tokens == 4


BAD = [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 251}, "truncate_prompt_tokens"),  # max_model_len 256 - max_tokens 6 = 250
    ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side"),
    ({"truncation_side": "right"}, "truncation_side"),  # nothing to truncate
    ({"return_token_ids": "yes"}, "return_token_ids"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_truncation_fields_are_refused_by_name(api, extra, param):
    for call in (api.completion, api.chat):
        with pytest.raises(openai.BadRequestError) as e:
            call(extra_body=extra)
        assert e.value.status_code == 400 and e.value.param == param, e.value.message


def test_cached_tokens_count_the_prefix_cache(api, tok):
    prompt = "Nothing before began like this: a prompt that spans a few blocks of the prefix cache."
    n = len(tok.encode(prompt))
    first = api.completion(prompt=prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = api.completion(prompt=prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK > 0
    chunks = list(api.completion(prompt=prompt, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    messages = [{"role": "user", "content": prompt}]
    n = len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False))
    assert api.chat(messages=messages).usage.prompt_tokens_details.cached_tokens == 0
    for stream in (False, True):
        options = {"stream_options": {"include_usage": True}} if stream else {}
        r = api.chat(messages=messages, stream=stream, **options)
        usage = list(r)[-1].usage if stream else r.usage
        assert usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK > 0


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True}, {"include_usage": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
def test_stream_usage_follows_vllms_stream_options(api, tok, options):
    for call, prompt_tokens in ((api.chat, len(chat_ids(tok))), (api.completion, len(tok.encode(PROMPT)))):
        chunks = list(call(n=2, max_tokens=5, stream=True, stream_options=options,
                           extra_body={"ignore_eos": True, "return_token_ids": True}))
        usages = [c.usage for c in chunks]
        if not options.get("include_usage"):  # continuous_usage_stats alone adds nothing, as in vLLM
            assert usages == [None] * len(chunks)
            continue
        last = chunks[-1]
        assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == \
            (prompt_tokens, 10)
        if not options.get("continuous_usage_stats"):
            assert usages[:-1] == [None] * (len(chunks) - 1)
            continue
        so_far = {0: 0, 1: 0}
        for c in chunks[:-1]:  # every chunk, the chat's role chunks too: its choice's tokens so far
            (choice,) = c.choices
            so_far[choice.index] += len(choice.model_extra.get("token_ids", []))  # a role chunk has none
            assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (prompt_tokens, so_far[choice.index])
            assert c.usage.total_tokens == prompt_tokens + so_far[choice.index]
            assert c.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens_details.cached_tokens
        assert so_far == {0: 5, 1: 5}


async def _async_engine_truncates(address: str, ids: list[int]) -> list:
    async with AsyncEngine.connect(address) as engine:
        sp = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=6, truncation_side="right")
        outs = [out async for out in engine.generate(ids, sp)]
        return outs[-1]


def test_async_engine_truncates_as_sampling_params_say(server, tok, path, hf_model):
    ids = tok.encode(PROMPT)
    out = asyncio.run(_async_engine_truncates(server.core_address, ids))
    assert out.prompt_token_ids == ids[:6]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), ids[:6], 4)
