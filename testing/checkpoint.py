"""Tiny random-weight Hugging Face checkpoints (llama, qwen2, qwen3) built offline for tests.

A checkpoint directory holds what a hub download would: config.json, generation_config.json,
safetensors weights (optionally sharded, with model.safetensors.index.json), and the test
tokenizer from `headrace.testing.tokenizer`. It also holds `headrace_factory.json`, the
arguments it was built with, so that a second call with the same arguments reuses it.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from headrace import envs
from headrace.testing.tokenizer import build_tokenizer

_CONFIGS: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}
FACTORY_FILE = "headrace_factory.json"
# Bump when the factory's output changes for the same arguments, to invalidate cached builds.
FACTORY_VERSION = 1
_DEMO: dict[str, Any] = dict(
    arch="qwen3",
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=256,
    tie_word_embeddings=True,
)


def _rope_parameters(rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5 takes rope settings as one `rope_parameters` dict (rope_type + rope_theta +
    the type's own keys) instead of the older top-level `rope_theta` and `rope_scaling`."""
    params: dict[str, Any] = {"rope_type": "default"}
    if rope_scaling is not None:
        scaling = dict(rope_scaling)
        if "type" in scaling:  # the legacy spelling of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        if "rope_theta" in scaling:
            raise ValueError("pass rope_theta as its own argument, not inside rope_scaling")
        params.update(scaling)
    params["rope_theta"] = float(rope_theta)
    return params


def _factory_args(arguments: dict[str, Any]) -> dict[str, Any]:
    """make_checkpoint's arguments (minus the path) as stored in FACTORY_FILE, JSON-normalized
    so that a freshly computed dict compares equal to the one read back."""
    args = {k: v for k, v in arguments.items() if k != "path"}
    args["factory_version"] = FACTORY_VERSION
    args["transformers_version"] = transformers.__version__
    return json.loads(json.dumps(args, sort_keys=True, default=str))  # dtype -> "torch.float32"


def _is_complete(path: Path, factory_args: dict[str, Any]) -> bool:
    """True if `path` holds a finished build with exactly these arguments. The factory file is
    written last, so its presence means every other file was written before it."""
    try:
        if json.loads((path / FACTORY_FILE).read_text()) != factory_args:
            return False
    except (OSError, ValueError):
        return False
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
    else:
        shards = {"model.safetensors"}
    required = {"config.json", "generation_config.json", "tokenizer.json", *shards}
    return all((path / name).is_file() for name in required)


def make_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    initializer_range: float = 0.1,
    max_shard_size: str | int | None = None,
    attention_bias: bool | None = None,
    full_vocab_tokenizer: bool = False,
    **extra_config: Any,
) -> Path:
    """Build a random-weight checkpoint of `arch` ("llama", "qwen2" or "qwen3") in `path`.

    Returns `Path(path)`. If `path` already holds a complete build with the same arguments it
    is returned as is; otherwise the factory's files there are (re)written.

    - vocab_size is `len(tokenizer)` unless given in extra_config; bos/eos/pad ids come from the
      tokenizer (0, 1, 2).
    - full_vocab_tokenizer fills the tokenizer with synthetic tokens up to the vocab_size given
      (`build_tokenizer(fill_to=)`), so that every id the model can sample has text.
    - head_dim defaults to hidden_size // num_heads (Qwen3Config's own default, 128, would not
      fit a tiny model).
    - rope: config.json gets a single `"rope_parameters"` dict, e.g.
      `{"rope_type": "default", "rope_theta": 10000.0}`, or with `rope_scaling` merged in, e.g.
      `{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256, "rope_theta": 10000.0}`. transformers 5 writes no
      top-level `rope_theta` or `rope_scaling` keys (the loaded config still answers
      `config.rope_scaling`, as an alias of `rope_parameters`). `rope_scaling` may spell the
      type as `rope_type` or the legacy `type`.
    - attention_bias applies to llama and qwen3 (passed when not None); qwen2 always has q/k/v
      biases and ignores it.
    - initializer_range defaults to 0.1, well above the usual 0.02, so that logits have clear
      top-1 margins and greedy decoding is not decided by near-ties.
    - max_shard_size (e.g. "20KB") shards the weights and writes model.safetensors.index.json.
    - extra_config is passed to the config class as is (e.g. `rms_norm_eps=1e-5`).
    """
    factory_args = _factory_args(locals())  # first statement: locals() is exactly the arguments
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if "rope_parameters" in extra_config:
        raise ValueError("pass rope_theta and rope_scaling instead of rope_parameters")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads})")
        head_dim = hidden_size // num_heads
    if full_vocab_tokenizer and "vocab_size" not in extra_config:
        raise ValueError("full_vocab_tokenizer needs a vocab_size to fill the tokenizer to")
    path = Path(path)

    if _is_complete(path, factory_args):
        return path

    path.mkdir(parents=True, exist_ok=True)
    # Drop a previous build's marker and weights first: stale shards or an index left over
    # from other arguments would otherwise be loaded along with the new weights.
    (path / FACTORY_FILE).unlink(missing_ok=True)
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)

    tokenizer = build_tokenizer(path, fill_to=extra_config["vocab_size"] if full_vocab_tokenizer else None)
    config_kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_theta, rope_scaling),
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if attention_bias is not None and arch != "qwen2":
        config_kwargs["attention_bias"] = attention_bias
    config_kwargs.update(extra_config)
    config = _CONFIGS[arch](**config_kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    # Explicit, so generation_config.json always exists and names the tokenizer's eos.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)

    (path / FACTORY_FILE).write_text(json.dumps(factory_args, indent=2, sort_keys=True) + "\n")
    return path


def demo_checkpoint() -> Path:
    """A somewhat larger Qwen3-style checkpoint, built once and cached under
    `envs.cache_dir() / "demo-qwen3"`.

    It is built in a temporary sibling directory and renamed into place, so a concurrent
    reader never sees a half-written checkpoint. If another builder wins the race its copy is
    kept; a stale copy (other factory version) is moved aside and replaced.
    """
    final = envs.cache_dir() / "demo-qwen3"
    bound = inspect.signature(make_checkpoint).bind(final, **_DEMO)
    bound.apply_defaults()
    expected = _factory_args(bound.arguments)
    if _is_complete(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".demo-qwen3-", dir=final.parent))
    try:
        built = make_checkpoint(work / "ckpt", **_DEMO)
        for _ in range(3):
            if _is_complete(final, expected):
                break
            try:
                os.rename(built, final)  # atomic; fails if `final` is a non-empty directory
                break
            except OSError:
                # `final` holds a stale build: move it aside (into `work`, removed below).
                with contextlib.suppress(OSError):
                    os.rename(final, work / "stale")
        else:
            raise RuntimeError(f"could not install the demo checkpoint at {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def make_scripted_checkpoint(path: str | Path, texts: list[str]) -> tuple[Path, list[list[int]]]:
    """A llama checkpoint whose greedy output is known in advance: it spells `texts`.

    Each layer's output projections are zero, so the final hidden state is
    the current token's embedding, a one-hot vector; lm_head maps token
    ids[i] of each text to ids[i + 1], and the last one to EOS. Prompting
    with a text's first token therefore generates the rest of its tokens
    and then EOS. Returns the path and those one-token prompts. The token
    ids of all texts together must be distinct (a token has one successor).
    """
    tokenizer = build_tokenizer(Path(path))
    vocab = len(tokenizer)
    hidden = -(-vocab // 8) * 8
    successor: dict[int, int] = {}
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text)
        for a, b in zip(ids, ids[1:] + [tokenizer.eos_token_id]):
            if a in successor:
                raise ValueError(f"token {a} of {text!r} already has a successor; pick texts with distinct tokens")
            successor[a] = b
        prompts.append(ids[:1])
    path = make_checkpoint(path, "llama", hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=4,
                           intermediate_size=8, max_position_embeddings=256)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    weights["model.embed_tokens.weight"] = torch.eye(vocab, hidden)
    head = torch.zeros(vocab, hidden)
    head[tokenizer.eos_token_id, :vocab] = 0.5  # unscripted tokens lead to EOS
    for a, b in successor.items():
        head[:, a] = 0
        head[b, a] = 1.0
    weights["lm_head.weight"] = head
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path, prompts


def copy_with_eos(src: str | Path, dst: str | Path, eos_token_id: int) -> Path:
    """A copy of checkpoint src whose EOS is eos_token_id (in config.json and
    generation_config.json), e.g. a token the model is known to emit."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos_token_id
        (dst / name).write_text(json.dumps(cfg))
    return dst
