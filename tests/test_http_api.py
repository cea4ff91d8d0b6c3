"""The OpenAI-compatible API of `headrace serve`, through the official openai
client, against transformers on the same checkpoint."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import urllib.request

import openai
import pytest
import torch

from headrace import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_logprobs
from tests.servers import Serve

pytestmark = pytest.mark.usefixtures("core_idle_after")  # (tests/conftest.py)

PROMPTS = ["The river is low today.", "今天天气很好，我们去河边散步吧。", "def f(x):\n    return x", "Emoji 👍🏽 and"]
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Where does the river go?"}]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3")


@pytest.fixture(scope="module")
def server(path):
    s = Serve(path, "--api-servers", "2")
    yield s
    assert s.stop() == 0
    assert not s.children()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_completions_match_transformers(client, model_name, tok, path, hf_model):
    model = hf_model(path)
    r = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=12, temperature=0)
    refs = [hf_greedy(model, tok.encode(p), 12) for p in PROMPTS]
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    for c, ref in zip(r.choices, refs):
        assert c.text == tok.decode(ref, skip_special_tokens=True)
        assert c.finish_reason == ("length" if len(ref) == 12 else "stop")
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(map(len, refs))
    assert r.object == "text_completion" and r.model == model_name
    ids = [7, 8, 9, 10, 11] * 5  # a token-id prompt
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0, echo=True)
    assert r.choices[0].text == tok.decode(ids) + tok.decode(hf_greedy(model, ids, 10), skip_special_tokens=True)


def test_streamed_completion_adds_up_to_the_whole_one(client, model_name, tok, path, hf_model):
    ref_ids = hf_greedy(hf_model(path), tok.encode(PROMPTS[1]), 20)
    ref = tok.decode(ref_ids, skip_special_tokens=True)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_logprobs_with_echo_match_transformers(client, model_name, tok, path, hf_model):
    model = hf_model(path)
    ids = tok.encode(PROMPTS[0])
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                  echo=True)
    lp = r.choices[0].logprobs
    gen = hf_greedy(model, ids, 6)
    ref = hf_logprobs(model, ids + gen)
    assert len(lp.tokens) == len(ids) + len(gen)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    for pos, tid in enumerate(ids + gen):
        assert lp.tokens[pos] == tok.decode([tid])
        if pos:
            assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, tid].item(), abs=1e-4)
            assert max(lp.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echo with logprobs scores the prompt, and vLLM's prompt_logprobs field holds those scores too
    echoed = r.choices[0].model_extra["prompt_logprobs"]
    assert echoed[0] is None and len(echoed) == len(ids)
    assert [echoed[pos][str(tid)]["logprob"] for pos, tid in enumerate(ids) if pos] == lp.token_logprobs[1:len(ids)]
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        assert plp[pos][str(ids[pos])]["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    # streamed: the same logprobs, in pieces
    chunks = [c for c in client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                   logprobs=3, echo=True, stream=True)]
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset


def chat_reference(tok, model, n: int):
    """transformers on CHAT: (prompt ids, n greedy tokens, log_softmax of every position)."""
    ids = chat_ids(tok, CHAT)
    gen = hf_greedy(model, ids, n)
    return ids, gen, hf_logprobs(model, ids + gen)


def test_chat_matches_transformers_with_top_logprobs(client, model_name, tok, path, hf_model):
    ids, gen, ref = chat_reference(tok, hf_model(path), 10)
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=3)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == tok.decode(gen, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(gen)
    for k, entry in enumerate(c.logprobs.content):
        row = ref[len(ids) + k - 1]
        assert entry.token == tok.decode([gen[k]]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(row[gen[k]].item(), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # streamed: the role first, then the same text and logprobs
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    streamed = [e.logprob for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-4)  # prefix-cache hit: other sums
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_chat_echo_and_continue_final_message(client, model_name, tok, path, hf_model):
    convo = CHAT + [{"role": "assistant", "content": "It goes"}]
    text = tok.apply_chat_template(convo, tokenize=False, continue_final_message=True)
    ids = tok.encode(text, add_special_tokens=False)
    gen = hf_greedy(hf_model(path), ids, 8)
    r = client.chat.completions.create(model=model_name, messages=convo, max_tokens=8, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert r.choices[0].message.content == "It goes" + tok.decode(gen, skip_special_tokens=True)


def test_n_samples_are_seeded_and_indexed(client, model_name):
    kw = dict(model=model_name, prompt=PROMPTS[:2], max_tokens=8, temperature=1.0, n=3, seed=11,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices[:3]}) > 1  # the samples of one prompt differ
    assert a.usage.completion_tokens == 6 * 8
    streamed: dict[int, str] = {}
    finished = set()
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == set(range(6))
    assert [streamed[i] for i in range(6)] == [c.text for c in a.choices]


def hf_beam_search(model, ids, width, n, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=n, do_sample=False,
                             max_new_tokens=max_new_tokens, attention_mask=None)
    return [seq[len(ids):].tolist() for seq in out]


def test_beam_search_and_best_of_as_extra_fields(client, model_name, tok, path, hf_model):
    model = hf_model(path)
    ids = tok.encode(PROMPTS[0])
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=8, n=2,
                                  extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 1.0,
                                              "early_stopping": False})
    ref = hf_beam_search(model, ids, 3, 2, 8)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [tok.decode(g, skip_special_tokens=True) for g in ref]
    chat_ids_ = chat_ids(tok, CHAT)
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6,
                                       extra_body={"use_beam_search": True, "best_of": 2})
    assert r.choices[0].message.content == tok.decode(hf_beam_search(model, chat_ids_, 2, 1, 6)[0],
                                                      skip_special_tokens=True)
    # best_of without beam search: n of best_of seeded samples, the most likely first
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=6, n=2, seed=3, temperature=1.0,
                                  logprobs=0, extra_body={"best_of": 4})
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert len(r.choices) == 2 and sums == sorted(sums, reverse=True)


def test_extra_body_fields_reach_the_engine(client, model_name, tok, path, hf_model):
    ids, gen, ref = chat_reference(tok, hf_model(path), 8)
    # top_k=1 samples greedily at any temperature; logprob_token_ids scores chosen ids at each position
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=8, temperature=1.5, logprobs=True,
                                       extra_body={"top_k": 1, "logprob_token_ids": [5, 9]})
    c = r.choices[0]
    assert c.message.content == tok.decode(gen, skip_special_tokens=True)
    for k, entry in enumerate(c.logprobs.content):
        assert [t.token for t in entry.top_logprobs] == [tok.decode([5]), tok.decode([9])]
        row = ref[len(ids) + k - 1]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([row[5].item(), row[9].item()], abs=1e-4)
    # in a completion with echo, the prompt's positions are scored on the same ids
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                  extra_body={"logprob_token_ids": [5, 9]})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(tok.encode(PROMPTS[0])) + 4 and lp.top_logprobs[0] is None
    assert all({tok.decode([5]), tok.decode([9])} <= set(top) for top in lp.top_logprobs[1:])
    # min_tokens and ignore_eos: exactly max_tokens tokens; a stop string cuts the text
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 12})
    assert r.usage.completion_tokens == 12
    full = r.choices[0].text
    stop = full[4:7]
    assert stop.strip(), full  # greedy: the same text every run
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop


def test_sampling_fields_match_the_offline_engine(client, model_name, path):
    """Penalties, logit_bias, min_p, top_k and the seed mean over HTTP what they
    mean in SamplingParams: a seeded request's text equals LLM.generate's."""
    fields = dict(temperature=0.9, top_p=0.95, seed=3, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=16)
    extra = dict(repetition_penalty=1.3, min_p=0.05, top_k=20, ignore_eos=True)
    bias = {"17": 8.0, "23": -100.0}
    r = client.completions.create(model=model_name, prompt=PROMPTS, logit_bias=bias, extra_body=extra, **fields)
    sp = SamplingParams(**fields, **extra, logit_bias={int(k): v for k, v in bias.items()})
    with LLM(path, max_model_len=256, block_size=8) as llm:
        offline = llm.generate(PROMPTS, sp, use_tqdm=False)
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0.9, seed=3, max_tokens=16), use_tqdm=False)
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in offline]
    assert [c.text for c in r.choices] != [o.outputs[0].text for o in plain]  # the fields changed something
    assert all(23 not in o.outputs[0].token_ids for o in offline)


BAD = [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=50), "logprobs"),
    (dict(max_tokens=1000), "max_tokens"),
    (dict(prompt=[5] * 300), "prompt"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),
    (dict(logit_bias={"five": 1}), "logit_bias"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"beam_width": 2}), "beam_width"),
    (dict(n=3, extra_body={"best_of": 2}), "best_of"),
    (dict(stream=True, extra_body={"use_beam_search": True, "best_of": 2}), "use_beam_search"),
    (dict(extra_body={"use_beam_search": True, "early_stopping": "soon"}), "early_stopping"),
    (dict(extra_body={"length_penalty": 2.0}), "length_penalty"),
    (dict(extra_body={"act_func": "tanh"}), "act_func"),
    (dict(extra_body={"top_k": "x"}), "top_k"),
]


@pytest.mark.parametrize("kwargs,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_parameters_are_refused_by_name(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": model_name, "prompt": "Hi", "max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and e.value.param == param, e.value.message
    assert e.value.type == "invalid_request_error"


BAD_CHAT = [
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(messages=[]), "messages"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(max_tokens=4, max_completion_tokens=5), "max_completion_tokens"),
    (dict(response_format={"type": "json_object"}), "response_format"),
]


@pytest.mark.parametrize("kwargs,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_parameters_are_refused_by_name(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": model_name, "messages": CHAT, **kwargs})
    assert e.value.status_code == 400 and e.value.param == param, e.value.message


def test_an_oversized_body_is_refused_with_413(server):
    from headrace.frontend.api.app import MAX_BODY_BYTES

    # Refused from its declared length, before any of it is sent.
    host, port = server.root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and "exceeds" in json.loads(body)["error"]["message"]


def test_unknown_model_is_404_and_the_server_serves_on(client, model_name):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=4)
    assert e.value.code == "model_not_found"
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=4).choices[0].finish_reason


def test_tokenize_detokenize_models_health(server, tok, model_name, path):
    def post(route, body):
        req = urllib.request.Request(server.root + route, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    ids = tok.encode(PROMPTS[1])
    assert post("/tokenize", {"prompt": PROMPTS[1]}) == {"tokens": ids, "count": len(ids), "max_model_len": 256}
    long = " ".join(PROMPTS) * 400  # tokenized on a worker thread
    assert post("/tokenize", {"prompt": long})["tokens"] == tok.encode(long)
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).completions.create(
            model=model_name, prompt=long, max_tokens=4)
    assert e.value.param == "prompt" and "max_model_len is 256" in e.value.message
    assert post("/tokenize", {"messages": CHAT})["tokens"] == chat_ids(tok, CHAT)
    assert post("/detokenize", {"tokens": ids}) == {"prompt": tok.decode(ids)}
    status, body = server.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == model_name == str(path)
    assert server.get("/health")[0] == 200
    status, body = server.get("/v1/nowhere")
    assert status == 404 and "error" in json.loads(body)


def test_many_concurrent_streams_match_transformers(server, model_name, tok, path, hf_model):
    """32 streams at once through both API servers, each with logprobs, each
    against transformers: the server's event loops are busy with all of them."""
    model = hf_model(path)
    prompts = [f"{p} {i}" for i in range(8) for p in PROMPTS]
    refs = [hf_greedy(model, tok.encode(p), 16) for p in prompts]

    async def one(prompt):
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
            stream = await c.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                                logprobs=2, stream=True)
            text, lps = "", []
            async for ch in stream:
                text += ch.choices[0].text
                lps += ch.choices[0].logprobs.token_logprobs
            return text, lps

    async def all_():
        return await asyncio.gather(*map(one, prompts))

    for (text, lps), ref in zip(asyncio.run(all_()), refs):
        assert text == tok.decode(ref, skip_special_tokens=True)
        assert len(lps) == len(ref) and all(math.isfinite(v) for v in lps)


def test_http_requests_are_counted_by_route_and_status(server, client, model_name):
    def count(route, status):
        return server.metric("headrace:http_requests_total", route=route, status=status)

    before = {k: count(*k) for k in [("/v1/completions", "200"), ("/v1/completions", "400"), ("other", "404")]}
    client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2, top_p=5.0)
    assert server.get("/v1/nowhere")[0] == 404
    for key, value in before.items():
        assert count(*key) == value + 1, key


def test_chat_streams_n_choices_and_stops_on_strings(client, model_name):
    kw = dict(model=model_name, messages=CHAT, max_tokens=12, temperature=1.0, seed=3, n=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    content, roles, finish = {0: "", 1: ""}, {}, {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            content[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and finish == {0: "length", 1: "length"}
    assert [content[i] for i in range(2)] == [c.message.content for c in whole.choices]
    # a stop string found mid-stream ends that choice there, in the stream as in the whole response
    text = whole.choices[0].message.content
    stop = text[3:6]
    assert stop.strip(), text  # seeded: the same text every run
    kw["stop"] = [stop]
    cut = client.chat.completions.create(**kw)
    streamed = "".join(c.delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
                       for c in ch.choices if c.index == 0)
    assert cut.choices[0].message.content == streamed == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
