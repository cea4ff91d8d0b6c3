"""The tiny-checkpoint factory: checkpoints load with transformers, the tokenizer is lossless."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from headrace.testing import CORPUS, build_tokenizer, demo_checkpoint, make_checkpoint
from tests.conftest import ARCHS

SAMPLES = [
    "Hello, world! The river is low today.",
    "  leading spaces, trailing\ttabs\n\n",
    "def f(x):\n    return x ** 2  # 42",
    "今天天气很好，我们去河边散步吧。",
    "東京から大阪まで新幹線で行きます。",
    "안녕하세요, 세계!",
    "👍🏽 👨‍👩‍👧 🇯🇵 1️⃣ 🏳️‍🌈",
    "mixed: 河 kawa 강 🌊 龘",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads(tmp_path, arch):
    path = make_checkpoint(tmp_path / arch, arch)
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    assert config.vocab_size == len(tok)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    # AutoTokenizer picks Qwen2Tokenizer for qwen2 (rebuilding the pipeline from its own code)
    # and TokenizersBackend otherwise; either way it must encode as the factory's tokenizer does.
    ref = build_tokenizer(tmp_path / "ref")
    for s in (*CORPUS, *SAMPLES):
        assert tok.encode(s) == ref.encode(s)

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.config.model_type == arch
    ids = torch.tensor([tok.encode(SAMPLES[0] + SAMPLES[3])])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    # The wide init gives clear top-1 margins: greedy decoding is not decided by near-ties.
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.02


def test_reuse_and_rebuild(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert make_checkpoint(tmp_path, "qwen3") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    make_checkpoint(tmp_path, "qwen3", seed=1)  # other arguments: rebuilt in place
    assert json.loads((path / "headrace_factory.json").read_text())["seed"] == 1


def test_sharded(tmp_path):
    path = make_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


def test_bad_arch(tmp_path):
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path, "gpt2")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
])
def test_rope_scaling_round_trip(tmp_path, scaling):
    path = make_checkpoint(tmp_path, "llama", rope_theta=500000.0, rope_scaling=scaling)
    assert json.loads((path / "config.json").read_text())["rope_parameters"] == {
        **scaling, "rope_theta": 500000.0}
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters == {**scaling, "rope_theta": 500000.0}


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer(tmp_path)
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("a") == tok.encode("a", add_special_tokens=True)  # no bos/eos added
    # Streaming tests need characters that span several byte-level tokens.
    assert len(tok.encode("龘")) > 1
    assert len(tok.encode("👨‍👩‍👧")) > 1
    assert len(tok.encode("👍🏽")) > 1
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    chat = reloaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_deterministic(tmp_path):
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_deterministic_across_processes(tmp_path):
    """Same files from another process with another hash seed (cache keys rely on it)."""
    make_checkpoint(tmp_path / "a", "qwen3")
    code = f"from headrace.testing import make_checkpoint; make_checkpoint({str(tmp_path / 'b')!r}, 'qwen3')"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_demo_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path))
    path = demo_checkpoint()
    assert path == tmp_path / "demo-qwen3"
    assert demo_checkpoint() == path
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen3"]  # no temporary leftovers
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.head_dim) == (
        "qwen3", 128, 4, 32)
    assert config.tie_word_embeddings
    # A stale copy (say, from an older factory) is replaced, not trusted.
    (path / "headrace_factory.json").write_text("{}")
    (path / "model.safetensors").unlink()
    assert demo_checkpoint() == path and (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen3"]


def test_tokenizer_fill(tmp_path):
    """fill_to: exactly that many tokens, the specials unchanged, lossless, deterministic."""
    build_tokenizer(tmp_path / "a", fill_to=3000)
    build_tokenizer(tmp_path / "b", fill_to=3000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == 3000
    assert tok.convert_ids_to_tokens(list(range(5))) == ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    for s in (*CORPUS, *SAMPLES):
        assert tok.decode(tok.encode(s)) == s
    texts = [tok.decode([i]) for i in range(len(tok))]
    assert all(texts)
    filled = texts[len(build_tokenizer(tmp_path / "unfilled")):]
    assert sum(t.isascii() for t in filled) > 0.8 * len(filled)
    assert sum(t.startswith(" ") for t in filled) > 0.3 * len(filled)
    assert any("\ufffd" in t for t in filled)  # CJK pieces that end inside a character
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path / "c", fill_to=999)


def test_full_vocab_checkpoint(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3", vocab_size=3000, full_vocab_tokenizer=True)
    assert AutoConfig.from_pretrained(path).vocab_size == len(AutoTokenizer.from_pretrained(path)) == 3000
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path / "no-size", "qwen3", full_vocab_tokenizer=True)
