"""Tensor and data parallelism on two GPUs (skipped with fewer), against one GPU."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from headrace import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from headrace.checkpoint import ConfigError
from headrace.executor.all_reduce import NO_MULTICAST_ENV
from tests.conftest import ARCHS
from tests.test_generate import prompts_of_lengths
from tests.test_tensor_parallel import _children, dead_worker_fails_the_engine_fast

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

LENGTHS = [1, 7, 16, 33, 100, 250]


def generate(path, sp, prompts, **kwargs):
    with LLM(path, device="cuda", max_model_len=512, **kwargs) as llm:
        return llm.generate(prompts, sp, use_tqdm=False)


@pytest.mark.parametrize("arch,nccl_only", [(arch, False) for arch in ARCHS] + [("qwen3", True)])
def test_tp2_float32_greedy_is_token_identical_to_tp1(arch, nccl_only, checkpoint):
    """With CUDA graphs and overlapped scheduling, as on one GPU; the
    all-reduces through peer memory, or (disable_custom_all_reduce) all through NCCL."""
    path = checkpoint(arch)
    prompts = prompts_of_lengths(1000, LENGTHS, seed=23)
    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    one = generate(path, sp, prompts, dtype="float32")
    two = generate(path, sp, prompts, dtype="float32", tensor_parallel_size=2, disable_custom_all_reduce=nccl_only)
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for ra, rb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: e.logprob for t, e in rb.items()} == pytest.approx(
                {t: e.logprob for t, e in ra.items()}, abs=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_bfloat16_logprobs_within_tolerance_of_tp1(arch, checkpoint):
    """bf16 sums in another order over two ranks: the chosen tokens' logprobs,
    each scored on the same prefix (prompt logprobs), stay within 0.05."""
    path = checkpoint(arch)
    prompts = prompts_of_lengths(1000, LENGTHS[1:], seed=29)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    one = generate(path, sp, prompts, dtype="bfloat16")
    two = generate(path, sp, prompts, dtype="bfloat16", tensor_parallel_size=2)
    for prompt, a, b in zip(prompts, one, two):
        for t, ra, rb in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert rb[t].logprob == pytest.approx(ra[t].logprob, abs=0.05)


def test_dp2_over_two_gpus_matches_one(checkpoint):
    path = checkpoint("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = prompts_of_lengths(1000, LENGTHS, seed=31)
    one = generate(path, SamplingParams(temperature=0, max_tokens=16), prompts, dtype="float32")

    async def main():
        async with AsyncEngine.from_model(str(path), data_parallel_size=2, device="cuda", dtype="float32",
                                          max_model_len=512) as engine:
            outs = await asyncio.gather(*(anext(engine.generate(p, sp)) for p in prompts))
            return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(main()) == [o.outputs[0].token_ids for o in one]


def test_an_engine_on_the_second_and_the_last_gpu_matches_the_first(checkpoint):
    """Each runner makes its GPU current for its kernels and graphs, whatever
    GPU this process has current."""
    path = checkpoint("qwen3")
    prompts = prompts_of_lengths(1000, LENGTHS, seed=37)
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)

    def run(device):
        with LLM(path, device=device, dtype="float32", max_model_len=512) as llm:
            return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                    for o in llm.generate(prompts, sp, use_tqdm=False)]

    first = run("cuda:0")
    for index in sorted({1, torch.cuda.device_count() - 1}):
        assert torch.cuda.current_device() == 0
        got = run(f"cuda:{index}")
        assert [ids for ids, _ in got] == [ids for ids, _ in first]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in first], abs=1e-4)


def test_gpus_the_machine_lacks_are_refused_by_name(checkpoint):
    path = checkpoint("qwen3")
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"cuda:{n}.*{n} GPU"):
        LLM(path, device=f"cuda:{n}")
    with pytest.raises(ConfigError, match=f"cuda:{n - 1} to cuda:{n}, but this machine has {n} GPU"):
        LLM(path, device=f"cuda:{n - 1}", tensor_parallel_size=2)

    async def dp():
        async with AsyncEngine.from_model(str(path), data_parallel_size=n + 1, device="cuda", max_model_len=256):
            pass

    with pytest.raises(Exception, match=f"data-parallel rank {n}.*cuda:{n}"):
        asyncio.run(dp())
    assert not _children(os.getpid(), "headrace")  # no core or worker left behind


def test_a_dead_worker_fails_a_gpu_engine_fast_and_leaves_no_process(checkpoint):
    asyncio.run(dead_worker_fails_the_engine_fast(checkpoint("qwen3"), "cuda"))


_RANK = """
import sys, torch, torch.distributed as dist
from headrace.executor.all_reduce import PeerAllReduce
rank, init = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="file://" + init, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
for dtype in (torch.bfloat16, torch.float32):
    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), dtype, 1 << 20)
    for n in (8, 4096, 5 * 4096, (1 << 20) // dtype.itemsize):
        x = torch.randn(n, generator=torch.Generator("cuda").manual_seed(rank * 7 + n), device="cuda").to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        assert torch.equal(peer(x), want), (dtype, n)
        out = torch.empty_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            peer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):  # the engine captures it in its step graphs
            for _ in range(3):
                out.copy_(peer(x))
        x.mul_(2)
        dist.all_reduce(want.mul_(0).add_(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), ("graph", dtype, n)
    assert not peer.fits(torch.empty(3, dtype=dtype, device="cuda"))  # 6 or 12 bytes: not 16-aligned
    assert not peer.fits(torch.empty((1 << 20) // dtype.itemsize + 8, dtype=dtype, device="cuda"))
print("ok")
"""


def test_the_peer_memory_all_reduce_equals_nccl_eagerly_and_in_graphs():
    """Sums of two ranks' bfloat16 and float32 vectors, bit for bit as NCCL's, called directly and replayed
    from a CUDA graph with new inputs."""
    with tempfile.TemporaryDirectory() as d:
        env = os.environ | NO_MULTICAST_ENV
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), f"{d}/init"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o.strip().endswith("ok") for o in outs), outs
