"""Shared fixtures: tiny checkpoints, their transformers reference, engine helpers."""
from __future__ import annotations

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
# headrace.kernels is first imported, which the imports below already do:
# without a GPU, kernels must run under the interpreter, so set it first.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter import skip_nested_patching

    skip_nested_patching()

import functools

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from headrace import LLM
from headrace.testing import make_checkpoint
from tests.cores import assert_core_idle

ARCHS = ["llama", "qwen2", "qwen3"]
# Per-arch shapes that exercise GQA, explicit head_dim, tied embeddings and q/k/v bias.
ARCH_KWARGS = {
    "llama": dict(num_heads=4, num_kv_heads=2),
    "qwen2": dict(num_heads=4, num_kv_heads=1),
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True),
}

torch.set_num_threads(2)

# Under pytest-xdist (./run.sh test, which keeps this order with --no-loadscope-reorder) each worker takes
# whole files in turn. The slowest go first, longest first (as timed on a 2-core CPU machine), so that the two
# workers finish close together. The soak test checks that no process's memory grows once its load has
# settled; beside the interpreted kernel tests on two cores its restarted core came back so late that its
# warm-up fell inside that window. So it starts after every kernel test, with only _TAIL left for the other
# worker: files that run no Triton kernel and, together, take about as long as the soak (3 minutes), so that
# the two workers still finish together.
_FIRST = ("test_attention_kernels.py", "test_gguf.py", "test_triton_kernels.py", "test_frontend_load.py",
          "test_http_serve.py", "test_int4_kernels.py", "test_dense_kernel.py")
_SOAK = "test_soak.py"
_TAIL = ("test_tokenizer.py", "test_generate.py", "test_layers.py", "test_http_api.py", "test_router.py",
         "test_metrics.py", "test_checkpoint_factory.py", "test_parallel_and_processors.py",
         "test_http_vllm_fields.py", "test_shutdown.py", "test_sampling_params.py", "test_overlap.py",
         "test_detokenizer.py", "test_step_brackets.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_FIRST)} | {_SOAK: len(_FIRST) + 1}
    rank |= {name: len(_FIRST) + 2 + i for i, name in enumerate(_TAIL)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(ckpt_dir):
    """checkpoint(arch, **kwargs) -> path, built once per distinct arguments."""
    built = {}

    def build(arch: str, **kwargs):
        key = arch + "".join(f"-{k}={v}" for k, v in sorted(kwargs.items()))
        if key not in built:
            built[key] = make_checkpoint(ckpt_dir / f"c{len(built)}", arch, **{**ARCH_KWARGS[arch], **kwargs})
        return built[key]

    return build


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model, float32, eval mode."""

    @functools.cache
    def load(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    return load


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, one prompt at a time (no padding)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, attention_mask=None
        )
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits for every position of token_ids: [len, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.fixture(scope="module")
def tok(path):
    """transformers' tokenizer of the module's checkpoint (its `path` fixture)."""
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def core_idle_after(server):
    """After the test, the core of the module's `headrace serve` (its `server` fixture) holds no
    request and every KV block is free."""
    yield
    assert_core_idle(server.core_address)


@pytest.fixture(autouse=True)
def every_engine_ends_clean(monkeypatch):
    """After every test, each LLM the test made holds no KV block, request or slot."""
    made = []
    init = LLM.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LLM, "__init__", tracking_init)
    yield
    try:
        for llm in made:
            assert_blocks_free(llm)
    finally:
        for llm in made:
            llm.shutdown()


def assert_blocks_free(llm: LLM) -> None:
    """Every KV block is back in the pool and no request or slot is left behind."""
    engine = llm.engine
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == engine.cache_config.num_blocks
    assert all(c == 0 for c in kv.pool.ref_counts)
    assert not engine.scheduler.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.executor.states.req_to_slot


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns memory filled with garbage-like values, so a
    launcher that leaves part of its output unwritten fails the comparison."""
    real_empty = torch.empty

    def empty(*size, dtype=None, **kwargs):
        t = real_empty(*size, dtype=dtype, **kwargs)
        if t.dtype == torch.bool:
            t.view(torch.uint8).fill_(2)  # neither False nor True: compared as bytes below
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(-77)
        return t

    monkeypatch.setattr(torch, "empty", empty)
