"""Triton's GPU compiler, run on the CPU: kernel launches made here under the interpreter are recorded (not
run), then compiled for an H100 (sm_90: Triton IR through PTX to a cubin) in a child process without the
interpreter. The interpreter runs Python, so it accepts kernels that the compiler rejects (a name bound in only
one branch of a constexpr `if`, say): those fail here rather than on the GPU. Each launch is compiled with the
constexprs a Hopper GPU gets where the CPU's differ (GPU_CONSTEXPRS)."""
from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

# Constexprs the launchers set from the device: on a Hopper GPU these values.
GPU_CONSTEXPRS = {"PDL": True, "UPCAST_DOT": False, "APPROX": True, "ASM": True, "NATIVE": True, "WIDEN16": True}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv"}

_COMPILE = r"""
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
failed = []
for k in json.load(sys.stdin):
    fn = getattr(importlib.import_module(k["module"]), k["name"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in k["aligned"]}
    try:
        compile(ASTSource(fn=fn, signature=k["signature"], constexprs=k["constexprs"], attrs=attrs),
                target=GPUTarget("cuda", 90, 32), options=k["options"])
    except Exception as e:
        failed.append(f"{k['name']} {k['constexprs']}: {type(e).__name__}: {e}")
print(json.dumps(failed))
"""


def _describe(fn, args: tuple, kwargs: dict, unspecialized=()) -> dict:
    """A launch as the compiler takes it: each argument's type, the constexprs' values (the GPU's where
    GPU_CONSTEXPRS names them), the compile options, and the arguments Triton's launcher marks as multiples
    of 16 (a tensor whose address is, an integer that is), which the compiler vectorises by. An integer
    argument equal to 1 is a constexpr, as the launcher makes it; do_not_specialize (unspecialized) exempts
    an integer from both."""
    params = inspect.signature(fn).parameters
    names = list(params)
    unspecialized = {names[u] if isinstance(u, int) else u for u in unspecialized}
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    if "launch_pdl" in options or "PDL" in params:
        options["launch_pdl"] = True
    bound = inspect.Signature(params.values()).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, aligned = {}, {}, []
    for i, (name, value) in enumerate(bound.arguments.items()):
        if "constexpr" in str(params[name].annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = GPU_CONSTEXPRS.get(name, value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                aligned.append(i)
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1 and name not in unspecialized:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and name not in unspecialized:
                aligned.append(i)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs,
                options=options, aligned=aligned)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch made under the interpreter while the test runs, described (_describe), not run."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records launches under the Triton interpreter (the CPU suite); a GPU compiles them anyway")
    seen: list[dict] = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append(_describe(self.fn, args, kwargs, self.kwargs.get("do_not_specialize") or ()))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    return seen


def _compile(launches: list[dict]) -> list[str]:
    unique = list({json.dumps(k, sort_keys=True): k for k in launches}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(unique), capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _paged_batch(lens: list[int], queries: list[int], heads=(16, 8), block=16, dtype=torch.bfloat16):
    num_heads, num_kv_heads = heads
    blocks = sum(-(-n // block) for n in lens) + 1
    kv = torch.zeros(2, blocks, block, num_kv_heads, 128, dtype=dtype)
    tables = torch.zeros(len(lens), max(-(-n // block) for n in lens), dtype=torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(queries)], dtype=torch.int32)
    q = torch.zeros(int(qsl[-1]), num_heads, 128, dtype=dtype)
    return q, kv, qsl, torch.tensor(lens, dtype=torch.int32), tables


def test_attention_and_sampling_kernels_compile_for_hopper(launches):
    from headrace.kernels.attention import paged_attention
    from headrace.kernels.qkv import decode_attention
    from headrace.kernels.input_prep import advance_slots
    from headrace.kernels.sampling import gumbel_sample

    # a mixed step (the general kernel, the decode kernel split and its reduce), decode steps split and unsplit
    q, kv, qsl, lens, tables = _paged_batch([300, 40, 77], [1, 40, 1])
    paged_attention(q, kv, qsl, lens, tables, 0.08, 40, 300)
    q, kv, qsl, lens, tables = _paged_batch([300, 40, 77], [1, 1, 1])
    order = torch.tensor([0, 2, 1], dtype=torch.int32)
    for kw in (dict(num_splits=1, order=order), dict(num_splits=4), dict(num_splits=4, ids_ahead=True)):
        paged_attention(q, kv, qsl, lens, tables, 0.08, 1, 300, **kw)
    # the decode kernel from q|k|v: rotary, Qwen3's q/k norm, the cache write
    qkv = torch.zeros(3, (16 + 2 * 8) * 128, dtype=torch.bfloat16)
    positions, slots = lens.long() - 1, torch.tensor([5, 70, 130])
    cos_sin = torch.zeros(512, 128)
    norms = [torch.ones(128, dtype=torch.bfloat16)] * 2
    for splits, weights in ((1, norms), (4, norms), (4, [None, None])):
        decode_attention(qkv, positions, cos_sin, *weights, 1e-6, kv, slots, 16, qsl, lens, tables, 0.08, 300,
                         splits)
    gumbel_sample(torch.zeros(3, 1000), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.ones(3))
    gumbel_sample(torch.zeros(1, 1), torch.tensor([1]), torch.tensor([4]))  # a vocabulary of one: a constexpr 1
    # by slot, as the sampler and the sampling graphs call it (a greedy slot's rows take no noise)
    gumbel_sample(torch.zeros(3, 1000, dtype=torch.bfloat16), torch.arange(9), torch.tensor([4, 5, 6]),
                  torch.ones(9), rows=torch.tensor([4, 0, 7]), counts=torch.zeros(9, dtype=torch.int32))
    idx, seq_lens = torch.tensor([4, 0, 7]), torch.tensor([5, 6, 7], dtype=torch.int32)
    for num_rows in (None, torch.tensor(2, dtype=torch.int32)):  # the eager step's advance and the graphs'
        advance_slots(idx, seq_lens, torch.arange(3), torch.zeros(3, dtype=torch.int64),
                      torch.zeros(9, dtype=torch.int32), torch.zeros(9, 16, dtype=torch.int32), num_rows=num_rows)

    names = {k["name"] for k in launches}
    assert {"_paged_attention_kernel", "_paged_decode_kernel", "_paged_decode_reduce_kernel",
            "_gumbel_sample_kernel", "_advance_slots_kernel"} <= names, names
    assert _compile(launches) == []


def test_projection_kernels_compile_for_hopper(launches):
    from headrace.kernels.activation import silu_and_mul
    from headrace.kernels.dense import dense_linear
    from headrace.kernels.fp8 import rms_norm_quantize, silu_and_mul_quantize
    from headrace.kernels.int4 import int4_linear, pack_int4, split_k_tiles
    from headrace.kernels.int4_gemv import int4_gemv
    from headrace.kernels.norm import rms_norm
    from headrace.kernels.splitk import counters

    bf16 = dict(dtype=torch.bfloat16)
    w, nw = torch.zeros(256, 128, **bf16), torch.ones(128, **bf16)
    for rows, gated in ((1, True), (1, False), (8, False)):  # the one-row kernel with the norm, and few rows
        x = torch.zeros(rows, 128, **bf16)
        dense_linear(x, w, None, (nw, 1e-6), torch.zeros(rows, 128, **bf16), gated)
    dense_linear(torch.zeros(2, 128, **bf16), w, None)  # o and down at two rows: the weights read before the wait
    wide, k_nw = torch.zeros(2056, 1100, **bf16), torch.ones(1100, **bf16)  # one row, wide and long: Qwen3-8B's
    dense_linear(torch.zeros(1, 1100, **bf16), wide, None)
    dense_linear(torch.zeros(1, 1100, **bf16), wide, None, (k_nw, 1e-6), torch.zeros(1, 1100, **bf16), True)
    x = torch.zeros(4, 128, **bf16)
    rms_norm(x, nw, 1e-6, torch.zeros(4, 128, **bf16))
    silu_and_mul(torch.zeros(4, 256, **bf16))
    rms_norm_quantize(x, nw, 1e-6, torch.zeros(4, 128, **bf16))
    silu_and_mul_quantize(torch.zeros(4, 256, **bf16))
    qweight = pack_int4(torch.zeros(256, 128, dtype=torch.uint8))
    scales, zeros = torch.ones(2, 128, **bf16), torch.zeros(2, 128, **bf16)
    counts = counters(split_k_tiles(128), torch.device("cpu"))
    for split_k in (0, 3):  # the one-row kernel, K whole and split, plain and with SiLU-and-mul
        int4_gemv(torch.zeros(1, 256, **bf16), qweight, scales, zeros, 128, None, counts, split_k)
        int4_gemv(torch.zeros(1, 256, **bf16), qweight, scales, zeros, 128, None, counts, split_k, gated=True)
    # deeper K loops, as benchmarks/int4_kernel.py --stages times them
    int4_gemv(torch.zeros(1, 256, **bf16), qweight, scales, zeros, 128, None, counts, 1, gated=True, stages=8)
    int4_gemv(torch.zeros(1, 256, **bf16), qweight, scales, zeros, 128, None, counts, 3, stages=3)
    # slices spanning two groups, as benchmarks/int4_kernel.py --sweep runs them
    int4_gemv(torch.zeros(1, 256, **bf16), qweight, scales, zeros, 128, None, counts, 1, config=(64, 256, 4, 8))
    int4_linear(torch.zeros(4, 256, **bf16), qweight, scales, zeros, 128, None, counts)  # tl.dot, K split

    names = {k["name"] for k in launches}
    assert len(names) >= 6, names
    assert _compile(launches) == []


def test_quantized_logprob_and_rotary_kernels_compile_for_hopper(launches, monkeypatch):
    from headrace.kernels import fp8
    from headrace.kernels.fp8 import few_rows_tiles, fp8_few_rows, fp8_mm, quantize_rows
    from headrace.kernels.gguf import gguf_linear
    from headrace.kernels.logprobs import top_logprobs
    from headrace.kernels.qkv import rope_and_cache
    from headrace.kernels.splitk import counters
    from tests.test_gguf_kernels import FORMATS, _weight

    cpu = torch.device("cpu")
    w, w_scale = quantize_rows(torch.zeros(128, 256))
    counts = counters(few_rows_tiles(128), cpu)
    for rows in (1, 4):  # the FP8 weights widened: FMAs for one row, tl.dot for a few
        fp8_few_rows(torch.zeros(rows, 256, dtype=torch.bfloat16), w, w_scale, None, counts)
    x_q, x_scale = quantize_rows(torch.zeros(80, 256))
    fp8_mm(x_q, x_scale, w, w_scale, torch.zeros(128, dtype=torch.bfloat16), torch.bfloat16, counts)
    for rows in (40, 24):  # each band of fp8.MM_CONFIGS; 24 rows in 32-token tiles, as W x^T
        fp8_mm(x_q[:rows], x_scale[:rows], w, w_scale, None, torch.bfloat16, counts)
    monkeypatch.setattr(fp8, "WIDE_TILES_PER_SM", 0.01)  # the wide configs, on the same small weight
    fp8_few_rows(torch.zeros(4, 256, dtype=torch.bfloat16), w, w_scale, None, counts)
    for rows in (80, 40):
        fp8_mm(x_q[:rows], x_scale[:rows], w, w_scale, None, torch.bfloat16, counts)
    for name in FORMATS:  # each GGUF block format, one row and a few
        _, p = _weight(name, 40, 512, seed=1)
        for rows in (1, 5):
            gguf_linear(torch.zeros(rows, 512, dtype=torch.bfloat16), p, None)
    top_logprobs(torch.zeros(3, 5000, dtype=torch.bfloat16), torch.tensor([1, 2, 3]),
                 torch.zeros(3, dtype=torch.int32), 5)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    for weights in ([torch.ones(64, dtype=torch.bfloat16)] * 2, [None, None]):
        rope_and_cache(torch.zeros(3, 8 * 64, dtype=torch.bfloat16), torch.tensor([0, 1, 2]), torch.zeros(16, 64),
                       *weights, 1e-6, cache, torch.tensor([0, 1, -1]), 4)

    names = {k["name"] for k in launches}
    assert len(names) >= 5, names
    assert _compile(launches) == []


_INT4_MMA_COMPILE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import compile
from triton.experimental.gluon._runtime import GluonASTSource
from headrace.kernels import int4_mma as M
out = []
for dtype, gated, r, group, bias, split, pdl in json.load(sys.stdin):
    ptr = "*" + dtype
    sig = dict(x_ptr=ptr, qw_ptr="*i32", s_ptr=ptr, z_ptr=ptr, bias_ptr=ptr, out_ptr=ptr, part_ptr="*fp32",
               count_ptr="*i32", N="i32", K="i32", k_per_split="i32", n_rows="i32", x_stride="i32")
    c = dict(GROUP=group, HAS_BIAS=bias, SPLIT=split > 1, MAX_SPLITS=split if 1 < split <= 16 else 0, GATED=gated,
             R=r, PDL=pdl)
    sig.update(dict.fromkeys(c, "constexpr"))
    ck = compile(GluonASTSource(fn=M._int4_mma_kernel, signature=sig, constexprs=c,
                                attrs={(i,): [["tt.divisibility", 16]] for i in range(8)}),
                 target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = ck.asm["ptx"]
    out.append([ptx.count("mma.sync.aligned.m16n8k16"), ck.metadata.shared, ptx.count("griddepcontrol.wait")])
print(json.dumps(out))
"""


def test_int4_mma_compiles_for_hopper():
    """The 4-bit tensor-core kernel (kernels/int4_mma.py, Gluon) through Triton's compiler for sm_90: plain and
    gated, bfloat16 and float16, groups of one step and one group for all of K, bias, K whole and split (the
    partials' sum unrolled or not), with and without PDL. It multiplies with mma.sync, builds its operands in
    registers (shared memory holds at most the split count's broadcast, no operand staging) and waits for the
    kernel before only with PDL."""
    from headrace.kernels import int4_mma
    if int4_mma.gluon is None:
        pytest.skip("this Triton has no Gluon")
    cases = [("bf16", False, 1, 128, False, 16, True), ("fp16", False, 1, 0, True, 1, True),
             ("bf16", True, 2, 128, True, 6, True), ("fp16", True, 2, 256, False, 1, False),
             ("bf16", False, 1, 128, False, 17, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _INT4_MMA_COMPILE], input=json.dumps(cases), capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for case, (mma, shared, wait) in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        assert mma >= 8 * case[2] and shared <= 16 and wait == (1 if case[6] else 0), (case, mma, shared, wait)
