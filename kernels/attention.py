"""Paged attention and the KV-cache write: torch references.

KV cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). A token at position p of a request lives in block
block_table[p // block_size] at offset p % block_size; its flat slot is
block_id * block_size + offset.
"""
from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] token -> flat slot, -1 to skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: list[int],  # [num_reqs + 1]
    seq_lens: list[int],  # [num_reqs] tokens in the cache after this step, queries included
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] request -> block ids
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's queries (its last tokens) over its cached keys.

    Mixed batches are fine: a decode row has one query, a prefill chunk many.
    Softmax runs in float32.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_q = end - start
        if num_q == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
