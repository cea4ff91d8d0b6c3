"""The engine on a CUDA device (skipped without one), against transformers in float32."""
from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
import torch

from headrace import LLM, AsyncEngine, SamplingParams
from headrace.checkpoint.config import ModelConfig
from headrace.executor.model_runner import kv_block_bytes
from headrace.kernels import compiled_variants
from tests.conftest import ARCHS, hf_greedy, hf_logprobs
from tests.test_generate import LENGTHS, prompts_of_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=7, max_num_seqs=3),  # chunked prefill
    dict(max_model_len=160, block_size=8, num_kv_blocks=20, max_num_batched_tokens=64),  # preemption
])
def test_float32_greedy_matches_transformers(arch, engine_kwargs, checkpoint, hf_model):
    path = checkpoint(arch)
    llm = LLM(path, device="cuda", dtype="float32", **{"max_model_len": 512, **engine_kwargs})
    assert llm.engine.executor.kv_caches[0].is_cuda
    lengths = [n for n in LENGTHS if n < llm.max_model_len - 30]
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, lengths, seed=21)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lone_request_float32_greedy_matches_transformers(arch, checkpoint, hf_model):
    """One request decodes at batch 1, where the projections take kernels/dense.py's one-row
    launch with their norm and activation folded in (and the Triton kernels chain by PDL)."""
    path = checkpoint(arch)
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=512)
    assert llm.engine.executor.model.layers[0].mlp.gate_up_proj.splitk_counts.is_cuda  # prepared for project()
    prompt = prompts_of_lengths(llm.engine.model_config.vocab_size, [37], seed=23)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), prompt, 24)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_default_close_to_float32_reference(arch, checkpoint, hf_model):
    """bf16 (the GPU default): logprobs within 0.15 of transformers' float32,
    and greedy tokens identical wherever float32's top-2 margin exceeds 0.3."""
    path = checkpoint(arch)
    llm = LLM(path, device="cuda", max_model_len=512)
    assert llm.engine.executor.dtype == torch.bfloat16
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [5, 60, 200], seed=22)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=3), use_tqdm=False)
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        ref = hf_logprobs(model, prompt + got.token_ids)[len(prompt) - 1 : -1]
        for pos, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[pos, tid].item(), abs=0.15)
            top2 = ref[pos].topk(2)
            if top2.values[0] - top2.values[1] > 0.3:
                assert token == top2.indices[0].item()
            else:
                break  # past a near tie the sequences may rightly differ


def test_seeded_sampling_matches_cpu(checkpoint):
    """The random source is a pure function of (seed, position, token): a CUDA
    run in float32 samples what the CPU run samples."""
    path = checkpoint("qwen3")
    prompts = prompts_of_lengths(1000, [9, 30, 4], seed=23)
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=s, max_tokens=12) for s in (1, 2, 3)]
    cpu = LLM(path, device="cpu", max_model_len=128).generate(prompts, sp, use_tqdm=False)
    gpu = LLM(path, device="cuda", dtype="float32", max_model_len=128).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_and_penalties_on_cuda_match_transformers(checkpoint, hf_model):
    """The Triton sampling kernels (scores, ranks, id fill, penalties) against
    transformers in float32."""
    path = checkpoint("llama")
    model = hf_model(path)
    prompt = [11, 12, 13, 14, 15, 40, 41, 40, 41]
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=6, logprob_token_ids=[1, 2, 300], act_func="sigmoid"),
              SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5)]
    ids_out, top_out, pen_out = llm.generate([prompt] * 3, params, use_tqdm=False)
    with torch.no_grad():
        ref_pen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 repetition_penalty=1.5)[0, len(prompt):].tolist()
    assert pen_out.outputs[0].token_ids == ref_pen
    for out, act in ((ids_out, "sigmoid"), (top_out, "log_softmax")):
        got = out.outputs[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got.token_ids])).logits[0].float()
        ref = logits.sigmoid() if act == "sigmoid" else logits.log_softmax(-1)
        for pos, entry in enumerate(got.logprobs):
            row = len(prompt) - 1 + pos
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[row, tid].item(), abs=1e-4)
    plp = top_out.prompt_logprobs
    lsm = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1).detach()
    for pos in range(1, len(prompt)):
        assert plp[pos][prompt[pos]].logprob == pytest.approx(lsm[pos - 1, prompt[pos]].item(), abs=1e-4)


def test_cuda_graph_and_eager_paths_agree(checkpoint):
    """Decode steps replayed from CUDA graphs (padded batch sizes) give the
    tokens and logprobs of the eager path."""
    path = checkpoint("qwen3")
    prompts = prompts_of_lengths(1000, [3, 40, 9, 17, 5], seed=31)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    graphs = LLM(path, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8)
    assert graphs.engine.executor.graphs is not None
    eager = LLM(path, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, enforce_eager=True)
    assert eager.engine.executor.graphs is None
    for batch in (prompts[:1], prompts[:3], prompts):  # 1, 3 (padded to 4) and 5 (padded to 8) rows
        a = graphs.generate(batch, params, use_tqdm=False)
        b = eager.generate(batch, params, use_tqdm=False)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert set(ex) == set(ey)
                for tid in ex:
                    assert ex[tid].logprob == pytest.approx(ey[tid].logprob, abs=1e-4)


def test_sampling_graphs_match_the_eager_path_and_the_cpu(checkpoint):
    """Decode steps whose rows all sample straight from their logits (greedy and seeded temperature rows)
    run the LM head, the sampling kernel and the slots' advance in a graph after the decode graph: they
    sample what the eager path and the CPU sample, at padded sizes too. A step with a row that asks for
    logprobs samples eagerly from the same graph output, and its plain rows' tokens do not change."""
    path = checkpoint("qwen3")
    prompts = prompts_of_lengths(1000, [3, 40, 9, 17, 5], seed=41)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16, ignore_eos=True)
              for t, s in ((0.8, 1), (0, None), (1.3, 2), (0.5, 3), (0, None))]
    graphs = LLM(path, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8)
    eager = LLM(path, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, enforce_eager=True)
    cpu = LLM(path, device="cpu", max_model_len=128, max_num_seqs=8)
    steps = graphs.engine.executor.graphs
    replay, sampled_steps = steps.run_sampled, []

    def counting(batch):
        sampled_steps.append(len(batch.req_ids))
        return replay(batch)

    steps.run_sampled = counting
    for n in (1, 3, 5):  # 3 and 5 rows run the graphs of 4 and 8
        sampled_steps.clear()
        want = [o.outputs[0].token_ids for o in cpu.generate(prompts[:n], params[:n], use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in eager.generate(prompts[:n], params[:n], use_tqdm=False)] == want
        assert [o.outputs[0].token_ids for o in graphs.generate(prompts[:n], params[:n], use_tqdm=False)] == want
        assert sampled_steps.count(n) >= 14, sampled_steps  # every decode step of the whole batch
    sampled_steps.clear()
    with_logprobs = params[:4] + [SamplingParams(temperature=0.7, seed=4, max_tokens=16, logprobs=2)]
    got = graphs.generate(prompts, with_logprobs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got[:4]] == want[:4]
    assert got[4].outputs[0].token_ids == eager.generate(prompts, with_logprobs, use_tqdm=False)[4].outputs[0].token_ids
    assert 5 not in sampled_steps


def test_mixed_step_graphs_and_eager_paths_agree(checkpoint, hf_model):
    """Prefill chunks beside decoding rows, replayed from the mixed graphs
    (padded token counts, empty padding rows), give the tokens and logprobs
    of the eager path, and the greedy tokens of transformers."""
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.core.protocol import unpack_ids

    path = checkpoint("qwen3")
    prompts = prompts_of_lengths(1000, [40, 3, 77, 9, 130, 21], seed=37)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)

    def run(enforce_eager: bool):
        core = EngineCore(EngineArgs(model=path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                                     max_num_batched_tokens=100, enforce_eager=enforce_eager))
        graphs, mixed_replays = core.executor.graphs, []
        if graphs is not None:
            replay = graphs.run

            def counting(batch):
                if batch.attn.max_query_len > 1:
                    mixed_replays.append((len(batch.req_ids), int(batch.query_start_loc_np[-1])))
                return replay(batch)

            graphs.run = counting
        tokens, logprobs = {}, {}
        for i, prompt in enumerate(prompts):  # a new prompt every second step, while the others decode
            core.add_request(str(i), prompt, params, 0.0)
            for _ in range(2):
                for out in core.step():
                    tokens.setdefault(out.request_id, []).extend(unpack_ids(out.new_token_ids).tolist())
                    logprobs.setdefault(out.request_id, []).append(np.frombuffer(out.logprobs, "<f4"))
        while core.has_unfinished:
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(unpack_ids(out.new_token_ids).tolist())
                logprobs.setdefault(out.request_id, []).append(np.frombuffer(out.logprobs, "<f4"))
        assert core.scheduler.kv.num_free_blocks == core.cache_config.num_blocks
        return tokens, {r: np.concatenate(v) for r, v in logprobs.items()}, mixed_replays

    tokens, logprobs, replays = run(enforce_eager=False)
    want_tokens, want_logprobs, _ = run(enforce_eager=True)
    # Steps of several rows with a prefill chunk among them, and chunks of the 130-token prompt.
    assert any(rows > 1 for rows, _ in replays) and any(t == 100 for _, t in replays)
    assert tokens == want_tokens
    for rid in tokens:
        np.testing.assert_allclose(logprobs[rid], want_logprobs[rid], atol=1e-4)
    model = hf_model(path)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == hf_greedy(model, prompt, 12)


MiB = 2**20


def big_kv_checkpoint(checkpoint):
    """A Qwen-style tiny model with a large KV cache per token (8 layers of 8
    KV heads of 128: 128 MiB per 4096-token sequence in bfloat16)."""
    return checkpoint("qwen3", num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128, max_position_embeddings=4096)


def test_llm_shutdown_releases_gpu_memory(checkpoint):
    """After shutdown the process holds no more GPU memory than before the
    LLM, allocated or reserved, although the test still holds the LLM; a
    second LLM gets the same KV pool and the same greedy tokens.

    The pool is min(utilization * total - allocated, free) less the
    activations' peak: memory an earlier engine left reserved (not
    allocated) counts only through `free`, so with utilization 0.6 a first
    pool left behind would cut the second one to the rest of the card.
    max_num_seqs is set so that the pool is sized by memory, not by it.
    """
    path = big_kv_checkpoint(checkpoint)
    _, total = torch.cuda.mem_get_info()
    blocks_per_seq = 4096 // 16
    per_seq = kv_block_bytes(ModelConfig.from_dir(path), 16, torch.bfloat16) * blocks_per_seq
    kwargs = dict(gpu_memory_utilization=0.6, max_num_seqs=-(-total // per_seq))
    prompts = prompts_of_lengths(1000, [5, 40, 300], seed=41)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gc.collect()  # or the first shutdown's collection frees what earlier tests left in cycles
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    llm = LLM(path, **kwargs)
    assert llm.engine.executor.graphs is not None
    num_blocks = llm.engine.cache_config.num_blocks
    assert num_blocks < kwargs["max_num_seqs"] * blocks_per_seq  # sized by memory
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert torch.cuda.memory_reserved() > reserved + 0.5 * total
    llm.shutdown()
    assert torch.cuda.memory_allocated() <= allocated + 4 * MiB
    assert torch.cuda.memory_reserved() <= reserved + 32 * MiB

    again = LLM(path, **kwargs)
    assert again.engine.cache_config.num_blocks == num_blocks
    assert [o.outputs[0].token_ids for o in again.generate(prompts, sp, use_tqdm=False)] == first


def test_async_engine_aclose_frees_the_spawned_cores_gpu_memory(checkpoint):
    """aclose() returns once the spawned core has exited, so the device's
    free memory is back to what it was before the core started."""
    path = big_kv_checkpoint(checkpoint)
    free_before, _ = torch.cuda.mem_get_info()

    async def main():
        engine = AsyncEngine.from_model(path, max_model_len=256, num_kv_blocks=8192)  # a 4 GiB pool
        async with engine:
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8))]
            assert len(outs[-1].outputs[0].token_ids) == 8
            free_running, _ = torch.cuda.mem_get_info()
        return engine._process.proc, free_running

    proc, free_running = asyncio.run(main())
    assert proc.returncode == 0  # exited by itself on SIGTERM, not killed
    assert free_running < free_before - 4 * 2**30  # the core's memory shows from this process
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after >= free_before - 64 * MiB


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_model_len=128, block_size=8, num_kv_blocks=40, max_num_batched_tokens=16),  # chunks, preemption
])
def test_float32_beam_search_matches_transformers(arch, engine_kwargs, checkpoint, hf_model):
    """Selection and forking on the device, with CUDA graphs, against transformers' beam search."""
    from tests.test_beam_search import beam_params, check_beams, hf_beams

    path = checkpoint(arch)
    llm = LLM(path, device="cuda", dtype="float32", **{"max_model_len": 256, **engine_kwargs})
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [40, 45, 50, 30, 60, 35], seed=23)
    params = [beam_params(w, n, lp) for w, n, lp in ((4, 4, 1.0), (2, 1, 0.0), (4, 2, 2.0))] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = hf_model(path)
    for prompt, sp, out in zip(prompts, params, outs):
        check_beams(out, hf_beams(model, prompt, sp, eos=None), sp, eos=None)


@pytest.mark.parametrize("m, k, n, bias", [(1, 256, 512, False), (7, 1024, 768, True), (64, 4096, 4096, False),
                                           (300, 512, 1536, True), (1, 12288, 1000, False), (16, 8192, 640, True),
                                           (17, 4096, 4096, False), (33, 1000, 130, True), (100, 12288, 512, False),
                                           (12, 1024, 40000, True), (48, 2048, 40000, False),
                                           (200, 12288, 512, False)])
def test_fp8_linear_matches_its_reference(m, k, n, bias):
    """Up to FEW_ROWS rows the Triton kernel (activations not quantized), more
    fp8_mm or _scaled_mm with per-token and per-channel scales, each against
    its arithmetic in float32: bf16 output rounding and, from 17 rows, the tensor cores' fast
    accumulation (0.6% of the largest output at 12288 of K on an H200) are the differences. N = 40000
    is a wide weight on GPUs of up to 312 SMs (kernels/fp8.wide)."""
    from headrace.kernels.fp8 import FEW_ROWS, fp8_few_rows_ref, fp8_linear, fp8_linear_ref, quantize_rows

    g = torch.Generator(device="cuda").manual_seed(m * k + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    got = fp8_linear(x, w, scale, b).float()
    ref = fp8_few_rows_ref if m <= FEW_ROWS else fp8_linear_ref
    want = ref(x.float(), w, scale, None if b is None else b.float())
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("m, k, n", [(33, 4096, 4096), (64, 1000, 130), (100, 12288, 512), (128, 256, 6144),
                                     (40, 1000, 40000), (20, 1000, 130), (32, 4096, 24576)])
def test_fp8_mm_matches_its_arithmetic(m, k, n, monkeypatch):
    """fp8_mm: the E4M3 products summed and scaled, against the same in torch (float64); torch.empty
    returns NaN-filled memory, so an output or partial left unwritten shows, and the split-K counters
    are back at zero after every call. K = 1000 leaves a partial slice; N = 130 a partial tile; N =
    40000 takes the wide config (on up to 312 SMs); 20 and 32 rows the 32-token tiles. Hopper's tensor
    cores add E4M3 products at reduced precision (kernels/fp8.py: 0.05-0.8% of the largest output off
    on Qwen3-8B's shapes), so both checks allow 1% of the largest output."""
    from headrace.kernels.fp8 import fp8_mm, fp8_mm_ref, few_rows_tiles, quantize_rows
    from headrace.kernels.splitk import counters

    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x_q, x_scale = quantize_rows(torch.randn(m, k, device="cuda", generator=g)
                                 * torch.linspace(0.01, 10, k, device="cuda"))
    w, w_scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    exact = fp8_mm_ref(x_q, x_scale, w, w_scale, b)
    want = exact.float()
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    counts = counters(few_rows_tiles(n), "cuda")
    for _ in range(2):
        got = fp8_mm(x_q, x_scale, w, w_scale, b, torch.bfloat16, counts)
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-2 * want.abs().max().item())
        assert not counts.any()
    got = fp8_mm(x_q, x_scale, w, w_scale, b, torch.float32, counts).double()
    err = (got - exact).abs().max().item() / exact.abs().max().item()
    assert err < 1e-2, f"float32 sums {err:.2e} of the largest output off"


def logprob_gaps(llm, ref, label: str, lengths=(17, 64, 150)) -> tuple[float, float]:
    """(mean, max) |logprob| difference between the engine and ref (float32),
    over every prompt token and 8 greedy decode tokens of prompts of these
    lengths, run together (decode batches take the few-rows kernels, one
    request the one-row ones; prefill the GEMM ones)."""
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, list(lengths), seed=9)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    diffs = []
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        ids = p + c.token_ids
        with torch.no_grad():
            lp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        diffs += [abs(entry[p[i]].logprob - lp[i - 1, p[i]].item())
                  for i, entry in enumerate(out.prompt_logprobs[1:], 1)]
        diffs += [abs(entry[t].logprob - lp[len(p) + j - 1, t].item())
                  for j, (t, entry) in enumerate(zip(c.token_ids, c.logprobs))]
    mean, top = sum(diffs) / len(diffs), max(diffs)
    print(f"{label}: logprob difference mean {mean:.4f} max {top:.4f}")
    return mean, top


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_engine_close_to_the_dequantized_reference(arch, checkpoint):
    """quantization='fp8' in bf16 with CUDA graphs: logprobs close to the FP8
    arithmetic done in float32 by transformers (tests/test_quantization.py)."""
    from transformers import AutoModelForCausalLM

    from tests.test_quantization import fp8_reference

    path = checkpoint(arch)
    ref = fp8_reference(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    llm = LLM(path, device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=256)
    assert llm.engine.executor.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    mean, top = logprob_gaps(llm, ref, f"fp8 {arch}")
    # Measured on an H100 (prompt tokens): mean 0.05-0.07, max 0.23-0.37. Activations in bf16 round to
    # FP8 differently from float32 ones now and then (one E4M3 step is 6%), which the max shows; a
    # wrong scale or layout moves logprobs by whole units.
    assert mean < 0.1 and top < 0.6


@pytest.mark.parametrize("fmt, opts", [("awq", dict(group=32)), ("gptq", dict(group=16, sym=False, desc_act=True)),
                                       ("gptq", dict(group=-1))])
def test_int4_engine_close_to_the_dequantized_reference(fmt, opts, checkpoint, tmp_path):
    """AWQ and GPTQ checkpoints in bf16 with CUDA graphs through the Triton
    w4a16 kernels: logprobs close to transformers on the dequantized weights,
    three requests at once and one alone (decoded by the one-row kernel,
    kernels/int4_gemv.py)."""
    from tests.quant_checkpoints import quantize_checkpoint
    from tests.test_quantization import reference

    src = checkpoint("qwen3")
    deq = quantize_checkpoint(src, tmp_path / fmt, fmt, **opts)
    llm = LLM(str(tmp_path / fmt), device="cuda", dtype="bfloat16", max_model_len=256)
    ref = reference(src, deq)
    for lengths in ((17, 64, 150), (150,)):
        mean, top = logprob_gaps(llm, ref, f"{fmt} {opts}, prompts of {lengths}", lengths)
        # bf16 activations and scales against float32: the same size of error as bf16 weights.
        assert mean < 0.05 and top < 0.3


def test_packed_gguf_engine_close_to_transformers(tmp_path):
    """Every supported GGUF block format kept packed (the GPU's default), in
    bf16 with CUDA graphs: logprobs close to transformers' float32 dequantized model."""
    from transformers import AutoModelForCausalLM

    from headrace.executor.models.quant import GGUFLinear
    from tests.test_gguf import BF16, F16, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, _tiny_gguf

    types = {"token_embd.weight": F16, "0.attn_q.weight": Q4_K, "0.attn_k.weight": Q6_K, "0.attn_v.weight": Q4_0,
             "0.attn_output.weight": Q4_1, "0.ffn_gate.weight": Q8_0, "0.ffn_up.weight": BF16,
             "1.attn_q.weight": Q6_K, "1.attn_k.weight": Q4_K, "1.ffn_down.weight": Q4_K,
             "1.ffn_gate.weight": Q4_1, "1.ffn_up.weight": Q4_1}
    path = _tiny_gguf(tmp_path / "tiny.gguf", types)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    prompts = prompts_of_lengths(256, [17, 64, 150], seed=9)
    packed = _sampled_logprob_gaps(path, ref, prompts, {}, GGUFLinear)
    dequantized = _sampled_logprob_gaps(path, ref, prompts, {"dequantize_gguf": True}, torch.nn.Linear)
    print(f"gguf bf16, logprob difference mean / max: packed {packed[0]:.4f} / {packed[1]:.4f}, "
          f"dequantized at load {dequantized[0]:.4f} / {dequantized[1]:.4f}")
    # The same rounding as the bf16 weights dequantized at load (a wrong block decodes whole units off).
    assert packed[0] < 1.5 * dequantized[0] + 0.01 and packed[1] < 1.5 * dequantized[1] + 0.05


def _sampled_logprob_gaps(path, ref, prompts, extra: dict, layer: type) -> tuple[float, float]:
    """(mean, max) |sampled logprob - ref's| over 12 greedy tokens per prompt,
    the core given token ids (the tiny GGUF file has no tokenizer)."""
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from tests.test_gguf import run_core

    core = EngineCore(EngineArgs(model=path, device="cuda", dtype="bfloat16", max_model_len=256, **extra))
    assert isinstance(core.executor.model.layers[1].mlp.gate_up_proj, layer)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    tokens, scores = run_core(core, prompts, sp)
    core.close()
    diffs = []
    for i, p in enumerate(prompts):
        lp = hf_logprobs(ref, p + tokens[str(i)])
        diffs += [abs(s - lp[len(p) + j - 1, t].item()) for j, (t, s) in enumerate(zip(tokens[str(i)], scores[str(i)]))]
    return sum(diffs) / len(diffs), max(diffs)


def test_other_batch_sizes_compile_no_new_kernel_variant(checkpoint):
    """Once requests have run to their ends (their last steps at one row), steps of another batch size,
    sampled and with the same logprobs, compile no Triton kernel variant: the kernels launched outside
    the CUDA graphs do not specialise on the counts that change with the batch (a compile mid-run
    stalls every request for a fraction of a second)."""
    llm = LLM(checkpoint("qwen3"), device="cuda", max_model_len=512)
    vocab = llm.engine.model_config.vocab_size

    def run(lengths, max_tokens, seed):
        prompts = prompts_of_lengths(vocab, lengths, seed=seed)
        params = [SamplingParams(temperature=0.8, max_tokens=m, logprobs=2, seed=i) for i, m in enumerate(max_tokens)]
        return llm.generate(prompts, params, use_tqdm=False)

    run([5, 30, 61], [4, 8, 12], seed=31)  # decode steps of 3, 2 and 1 rows
    before = compiled_variants()
    assert before
    outs = run([7 + 3 * i for i in range(16)], [6] * 16, seed=32)  # 16 rows, sampling 16 tokens a step
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert compiled_variants() == before
