"""Quantized weights: the engine against transformers' model code on the
same weights dequantized (float32), greedy and token for token.

fp8 at load quantizes a float checkpoint; FP8, AWQ and GPTQ checkpoints are
written by tests/quant_checkpoints.py in each format's packing."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from headrace import LLM, SamplingParams
from headrace.checkpoint import ConfigError
from headrace.config import EngineArgs
from headrace.executor.models.quant import Fp8Linear, Int4Linear, resolve_quantization
from headrace.executor.parallel import TPGroup
from tests.conftest import ARCHS, assert_blocks_free, hf_greedy
from tests.quant_checkpoints import PROJECTIONS, quantize_checkpoint
from tests.test_generate import prompts_of_lengths


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled so their largest magnitude is 448, rounded to E4M3, scaled back."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def fp8_reference(model: nn.Module) -> nn.Module:
    """transformers' model with every decoder projection's weight quantized per
    output channel and its input per token: FP8 arithmetic, dequantized."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.weight.data = fake_fp8(module.weight.data)
            module.register_forward_pre_hook(lambda m, args: (fake_fp8(args[0]),))
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_greedy_matches_the_dequantized_reference(arch, checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    path = checkpoint(arch)
    ref = fp8_reference(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = assert_greedy_matches(path, ref, plain, quantization="fp8")
    layer = llm.engine.executor.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight.element_size() == 1
    llm.shutdown()


def test_unknown_quantization_is_refused():
    for name in ("int4", "FP8", "squeezellm"):
        with pytest.raises(ValueError, match="quantization must be None or one of"):
            EngineArgs(model="unused", quantization=name)


# (arch, format, options): every architecture in every format; GPTQ over
# symmetric and not, desc_act and not, and the one-group case; the group
# sizes that occur (16, 32, 64) and 128 where the features allow it.
INT4_CASES = [
    ("llama", "awq", dict(group=32)),
    ("qwen2", "awq", dict(group=16)),
    ("qwen3", "awq", dict(group=64)),
    ("llama", "gptq", dict(group=32, sym=True, desc_act=False)),
    ("qwen2", "gptq", dict(group=16, sym=False, desc_act=True)),
    ("qwen3", "gptq", dict(group=-1, sym=True, desc_act=True)),
    ("qwen3", "gptq", dict(group=128, sym=False, desc_act=False, hidden_size=128, intermediate_size=256)),
    ("llama", "gptq", dict(group=32, sym=False, desc_act=True, lm_head=True)),
    ("qwen2", "gptq", dict(group=16, sym=True, desc_act=False, lm_head=True)),
]
SHAPE_KEYS = ("hidden_size", "intermediate_size")


def reference(src, deq: dict, hooks: dict | None = None) -> nn.Module:
    """transformers' model on src with the dequantized weights; hooks: module
    name suffix -> a function applied to that module's input."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    missing = model.load_state_dict({k: v for k, v in deq.items() if k.endswith(".weight")}, strict=False)
    assert not missing.unexpected_keys
    for name, module in model.named_modules():
        for suffix, fn in (hooks or {}).items():
            if name.endswith(suffix):
                module.register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]),))
    return model


def assert_greedy_matches(path, ref: nn.Module, plain: nn.Module | None = None, **kwargs) -> LLM:
    """Greedy output token-identical to ref's; with plain (the float model),
    also that quantization changed some output, so the test can tell. The
    engine runs on the CPU on any machine: there the layers run the
    dequantizing references, which ref's arithmetic is. On a GPU they run
    the kernels, whose arithmetic differs by design (the few-rows FP8 kernel
    leaves its input unquantized); test_gpu.py holds those to their own."""
    kwargs = {"device": "cpu", **kwargs}
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=32, **kwargs)  # chunked prefill too
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [3, 17, 40, 90], seed=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    differs = 0
    for p, out in zip(prompts, outs):
        want = hf_greedy(ref, p, 12)
        assert out.outputs[0].token_ids == want
        differs += plain is not None and hf_greedy(plain, p, 12) != want
    assert plain is None or differs, "quantization changed no output: the test cannot tell"
    assert_blocks_free(llm)
    return llm


@pytest.mark.parametrize("arch, fmt, opts", INT4_CASES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}={x}" for k, x in v.items() if k not in SHAPE_KEYS))
def test_int4_checkpoint_matches_the_dequantized_reference(arch, fmt, opts, checkpoint, tmp_path, hf_model):
    shape = {k: opts.pop(k) for k in SHAPE_KEYS if k in opts}
    src = checkpoint(arch, **shape)
    deq = quantize_checkpoint(src, tmp_path / fmt, fmt, **opts)
    llm = assert_greedy_matches(tmp_path / fmt, reference(src, deq), hf_model(src))
    layer = llm.engine.executor.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert isinstance(proj, Int4Linear) and proj.qweight.dtype == torch.int32
    # desc_act reorders the input features, unless there is one group
    assert (layer.self_attn.qkv_proj.perm is not None) == (opts.get("desc_act", False) and opts["group"] != -1)
    head = llm.engine.executor.model.lm_head  # a GPTQ checkpoint's quantized LM head (lm_head: true) stays so
    assert isinstance(head, Int4Linear) == opts.get("lm_head", False)
    assert llm.engine.quantization.endswith(", lm_head too)") == opts.get("lm_head", False)
    llm.shutdown()


def fake_fp8_static(scale: torch.Tensor):
    return lambda x: (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("arch, static", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_fp8_checkpoint_matches_the_dequantized_reference(arch, static, checkpoint, tmp_path, hf_model):
    """E4M3 weights with per-tensor and per-channel weight_scale tensors as
    they are stored; activations per token, or by the static input_scale (a
    fused projection takes the largest of its parts')."""
    src = checkpoint(arch)
    deq = quantize_checkpoint(src, tmp_path / "fp8", "fp8", static=static)
    hooks = {p: fake_fp8 for p in PROJECTIONS}
    if static:
        hooks = {}
        for stem in {k.rsplit(".", 2)[0] for k in deq}:  # model.layers.N.self_attn / .mlp
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)):
                names = [f"{stem}.{p}.input_scale" for p in group if f"{stem}.{p}.input_scale" in deq]
                if names:
                    top = max(deq[n] for n in names)
                    hooks |= {n.removesuffix(".input_scale"): fake_fp8_static(top) for n in names}
    llm = assert_greedy_matches(tmp_path / "fp8", reference(src, deq, hooks), hf_model(src))
    proj = llm.engine.executor.model.layers[1].mlp.gate_up_proj
    assert isinstance(proj, Fp8Linear) and proj.weight.dtype == torch.float8_e4m3fn
    assert (proj.input_scale is not None) == static
    llm.shutdown()


def _with_config(src, dst, **quant_config) -> str:
    quantize_checkpoint(src, dst, "gptq", group=32)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] |= quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_bad_quantized_checkpoints_are_refused_by_name(checkpoint, tmp_path):
    src = checkpoint("llama")
    cases = [
        (dict(bits=8), r"quantization_config\.bits=8 is not supported: only 4-bit"),
        (dict(quant_method="squeezellm"), r"quant_method='squeezellm' is not supported"),
        (dict(checkpoint_format="gptq_v2"), r"checkpoint_format='gptq_v2'"),
        (dict(group_size=48), r"in_features 128 is not a multiple of the group size 48"),
        (dict(group_size=8), r"group size 8 is not supported: the int4 kernel takes groups of a multiple of 16"),
        (dict(group_size=64), r"down_proj: qzeros has shape \(4, 8\), expected \(2, 8\)"),  # written for 32
        (dict(lm_head="yes"), r"quantization_config\.lm_head='yes' is not supported: true or false"),
        (dict(quant_method="awq", lm_head=True), r"lm_head=True is not supported: only GPTQ checkpoints"),
        (dict(lm_head=True), r"lm_head is true, but the checkpoint stores lm_head\.weight unquantized"),
    ]
    for i, (override, message) in enumerate(cases):
        with pytest.raises(ConfigError, match=message):
            LLM(_with_config(src, tmp_path / f"bad{i}", **override), max_model_len=64)
    tied = tmp_path / "tied"
    # tied: the checkpoint has no lm_head.weight to quantize, but its config says lm_head: true
    quantize_checkpoint(checkpoint("qwen3"), tied, "gptq", group=32, lm_head=True)
    with pytest.raises(ConfigError, match=r"lm_head is true, but the model ties its LM head to the embedding table"):
        LLM(str(tied), max_model_len=64)
    with pytest.raises(ConfigError, match=r"quantization='awq'.*holds gptq weights"):
        LLM(_with_config(src, tmp_path / "ok", bits=4), quantization="awq", max_model_len=64)
    with pytest.raises(ConfigError, match=r"quantization='gptq'.*holds no gptq weights"):
        LLM(str(src), quantization="gptq", max_model_len=64)
    with pytest.raises(ConfigError, match=r"quantization='gguf'.*not a GGUF file"):
        LLM(str(src), quantization="gguf", max_model_len=64)
    with pytest.raises(ConfigError, match="dequantize_gguf applies to a GGUF file"):
        LLM(str(src), dequantize_gguf=True, max_model_len=64)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is not supported"):
        LLM(str(tmp_path / "ok"), tensor_parallel_size=2, max_model_len=64)


def test_serve_quantization_fp8_answers_through_the_openai_client(checkpoint):
    """`headrace serve --quantization fp8`: the openai client gets the FP8
    reference's greedy text, and /metrics names the quantization."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.servers import Serve

    path = checkpoint("qwen3")
    ref = fp8_reference(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    server = Serve(path, "--quantization", "fp8", "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        prompt = prompts_of_lengths(len(tokenizer), [20], seed=3)[0]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].text == tokenizer.decode(hf_greedy(ref, prompt, 10), skip_special_tokens=True)
        shown = "fp8 (e4m3, quantized at load, per-token activation scales)"
        assert server.metric("headrace:quantization_info", quantization=shown) == 1
    finally:
        assert server.stop() == 0


class ModelDtypeBytes(TorchDispatchMode):
    """The most bytes that tensors of `dtype` made by torch ops while active
    held at once (each storage counted once, until it is freed)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.live, self.peak = dtype, {}, 0  # storage -> (weak reference, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.device.type != "meta":
                storage = t.untyped_storage()
                self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


# (checkpoint format or "at-load" for fp8 quantizing a float checkpoint, quantize_embeddings)
LOAD_CASES = [("at-load", False), ("at-load", True), ("fp8", False), ("gptq", True), ("awq", False)]


@pytest.mark.parametrize("fmt, vocab", LOAD_CASES)
def test_loading_holds_at_most_one_float_weight_beside_the_quantized_model(fmt, vocab, checkpoint, tmp_path):
    """Loaded in bfloat16 from float32 (or quantized) tensors: the bfloat16
    tensors alive at any time during load are the quantized model's own plus
    at most the one weight being quantized (and its quantizer's temporary),
    never all the projections in bfloat16 first."""
    from headrace.checkpoint.config import ModelConfig
    from headrace.executor.models.llama import LlamaForCausalLM
    from headrace.executor.models.loader import load_model

    src = checkpoint("llama", num_layers=4, hidden_size=128, intermediate_size=256)
    path = src if fmt == "at-load" else tmp_path / fmt
    if fmt != "at-load":
        quantize_checkpoint(src, path, fmt, group=32)
    cfg = ModelConfig.from_dir(path)
    args = EngineArgs(model=str(path), quantization="fp8" if fmt == "at-load" else None, quantize_embeddings=vocab)
    quant = resolve_quantization(args, cfg, torch.device("cpu"), torch.bfloat16, 1)
    with ModelDtypeBytes(torch.bfloat16) as mode:
        model = load_model(cfg, torch.bfloat16, torch.device("cpu"), 64, quant=quant)
    held = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]
               if t.dtype == torch.bfloat16)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.device("meta"):  # the float model's shapes
        floats = {n: p.numel() * 2 for n, p in LlamaForCausalLM(cfg, 64).named_parameters()}
    vocab_names = ("embed_tokens.", "lm_head.") if vocab else ()
    replaced = [n for n in floats if n.endswith("_proj.weight") or n.startswith(vocab_names)]
    largest = max(floats[n] for n in replaced)
    # the weight being quantized, the |weight| its quantizer takes, and their row maxima
    assert mode.peak <= held + 2 * largest + largest // 8
    assert sum(floats[n] for n in replaced) > 4 * largest, "the bound could not tell one weight from all of them"


def fp8_vocab(model: nn.Module) -> nn.Module:
    """transformers' model with the embedding table and LM head (one table
    when tied) replaced by their FP8 values per row, dequantized, and the LM
    head's input quantized per token, as an Fp8Linear does."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight
    embed.weight.data = fake_fp8(embed.weight.data)
    if not tied:
        head.weight.data = fake_fp8(head.weight.data)
    head.register_forward_pre_hook(lambda m, args: (fake_fp8(args[0]),))
    return model


# (arch, format): tied (qwen3) and untied tables, fp8 at load and each checkpoint format
VOCAB_CASES = [("llama", "at-load"), ("qwen3", "at-load"), ("qwen2", "gptq"), ("qwen3", "awq"), ("llama", "fp8")]


@pytest.mark.parametrize("arch, fmt", VOCAB_CASES)
def test_quantize_embeddings_matches_the_dequantized_reference(arch, fmt, checkpoint, tmp_path):
    """quantize_embeddings: transformers on the same weights with the table
    and head as their FP8 values; against the same without them, the flag
    changes some output."""
    from transformers import AutoModelForCausalLM

    from headrace.executor.models.quant import Fp8Embedding

    src = checkpoint(arch)
    path = src if fmt == "at-load" else tmp_path / fmt
    deq = None if fmt == "at-load" else quantize_checkpoint(src, path, fmt, group=32)

    def projections_reference() -> nn.Module:
        if fmt == "at-load":
            return fp8_reference(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval())
        return reference(src, deq, {p: fake_fp8 for p in PROJECTIONS} if fmt == "fp8" else None)

    llm = assert_greedy_matches(path, fp8_vocab(projections_reference()), projections_reference(),
                                quantize_embeddings=True, quantization="fp8" if fmt == "at-load" else None)
    model = llm.engine.executor.model
    assert isinstance(model.embed_tokens, Fp8Embedding) and isinstance(model.lm_head, Fp8Linear)
    assert model.embed_tokens.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.shape[0] == 1008  # 1000 rows padded for _scaled_mm, which takes multiples of 16
    assert (model.lm_head.weight is model.embed_tokens.weight) == (arch == "qwen3")  # tied: one table
    assert llm.engine.quantization.endswith("; embeddings and lm_head fp8 (e4m3, per row)")
    llm.shutdown()


def test_quantize_embeddings_is_refused_without_a_quantization_and_for_gguf(checkpoint, tmp_path):
    from headrace.core.engine import EngineCore
    from tests.test_gguf import Q8_0, _tiny_gguf

    with pytest.raises(ValueError, match="quantize_embeddings must be True or False"):
        EngineArgs(model="unused", quantize_embeddings=1)
    with pytest.raises(ConfigError, match=r"quantize_embeddings .* runs unquantized: set quantization='fp8'"):
        LLM(str(checkpoint("llama")), quantize_embeddings=True, max_model_len=64)
    path = _tiny_gguf(tmp_path / "tiny.gguf", {"attn_q.weight": Q8_0})
    for extra in ({}, {"quantization": "gguf"}, {"dequantize_gguf": True}):
        with pytest.raises(ConfigError, match="quantize_embeddings does not apply to a GGUF file of quantized "
                                              "blocks .*: the file decides its own tensor types"):
            EngineCore(EngineArgs(model=path, device="cpu", quantize_embeddings=True, **extra))


class _Alone(TPGroup):
    """A rank's group whose collectives leave its own part as it is (no other rank runs)."""

    def all_reduce(self, x):
        return x

    def all_gather_columns(self, x, dtype):
        return x.to(dtype)


def test_quantize_embeddings_splits_the_vocabulary_over_ranks(checkpoint):
    """Each of two ranks holds its rows of the FP8 table and head (the last
    rank's padded): their lookups add up to one rank's, and their logits side
    by side are one rank's."""
    from headrace.checkpoint.config import ModelConfig
    from headrace.executor.models.loader import load_model

    path = checkpoint("qwen2", vocab_size=1001)
    cfg = ModelConfig.from_dir(path)
    args = EngineArgs(model=str(path), quantization="fp8", quantize_embeddings=True)
    quant = resolve_quantization(args, cfg, torch.device("cpu"), torch.float32, 2)
    one, *ranks = [load_model(cfg, torch.float32, torch.device("cpu"), 64, tp, quant)
                   for tp in (TPGroup(), _Alone(rank=0, size=2), _Alone(rank=1, size=2))]
    ids = torch.arange(cfg.vocab_size)
    assert torch.equal(sum(m.embed(ids) for m in ranks), one.embed(ids))
    hidden = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = torch.cat([m.compute_logits(hidden) for m in ranks], dim=1)[:, : cfg.vocab_size]
    torch.testing.assert_close(logits, one.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def test_quantize_embeddings_on_two_ranks(checkpoint):
    """The workers build the FP8 table and head too (greedy output as one rank's
    is not expected: the projections' inputs are quantized per rank's slice)."""
    path = checkpoint("qwen2", vocab_size=1001)
    with LLM(path, tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=64, quantization="fp8",
             quantize_embeddings=True) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
        assert llm.engine.quantization.endswith("embeddings and lm_head fp8 (e4m3, per row)")
