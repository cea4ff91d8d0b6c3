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
    Decode rows are computed together, padded to the longest context;
    prefill rows one at a time. Softmax runs in float32.
    """
    out = torch.empty_like(q)
    decode = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        starts = torch.tensor([query_start_loc[i] for i in decode], device=q.device)
        lens = torch.tensor([seq_lens[i] for i in decode], device=q.device)
        out[starts] = _attend(q[starts, None], kv_cache, block_tables[rows], lens, max(seq_lens[i] for i in decode),
                              scale)[:, 0]
    for i in sorted(set(range(len(seq_lens))) - set(decode)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end > start:
            lens = torch.tensor([seq_lens[i]], device=q.device)
            out[start:end] = _attend(q[None, start:end], kv_cache, block_tables[i : i + 1], lens, seq_lens[i],
                                     scale)[0]
    return out


def _attend(q, kv_cache, block_tables, seq_lens, max_len: int, scale: float) -> torch.Tensor:
    """q [rows, num_q, heads, dim], each row's queries being the last num_q
    positions of its sequence; keys past a row's seq_len are masked."""
    num_heads, head_dim = q.shape[2], q.shape[3]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [rows, num_blocks]
    k = kv_cache[0, blocks].flatten(1, 2)[:, :max_len]  # [rows, max_len, kv_heads, dim]
    v = kv_cache[1, blocks].flatten(1, 2)[:, :max_len]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), k) * scale
    num_q = q.shape[1]
    q_pos = seq_lens[:, None] - num_q + torch.arange(num_q, device=q.device)[None, :]  # [rows, num_q]
    k_pos = torch.arange(max_len, device=q.device)
    masked = k_pos[None, None, :] > q_pos[:, :, None]  # causal, and past the row's length
    scores.masked_fill_(masked[:, None], float("-inf"))
    return torch.einsum("rhqk,rkhd->rqhd", scores.softmax(dim=-1), v).to(q.dtype)
