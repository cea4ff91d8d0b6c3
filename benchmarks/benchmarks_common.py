"""Checkpoints the benchmarks share."""
from __future__ import annotations


def qwen3_06b_checkpoint():
    """The Qwen3-0.6B shape with random bf16 weights, built once and cached:
    hidden 1024, 28 layers, 16 query and 8 KV heads of 128, intermediate
    3072, vocabulary 151936, tied embeddings."""
    import torch

    from headrace import envs
    from headrace.testing import make_checkpoint

    return make_checkpoint(envs.cache_dir() / "qwen3-0.6b-random", "qwen3", hidden_size=1024, num_layers=28,
                           num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                           tie_word_embeddings=True, vocab_size=151936, max_position_embeddings=4096,
                           dtype=torch.bfloat16, initializer_range=0.02, rope_theta=1000000.0)
