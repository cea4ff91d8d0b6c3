"""The attention layer over the paged KV cache, and its per-step metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headrace import envs
from headrace.kernels import dispatch
from headrace.kernels.attention import paged_attention, paged_attention_ref
from headrace.kernels.qkv import decode_attention


@dataclass
class AttentionMetadata:
    """Where this step's queries sit and which cache blocks they read."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, batch row -> first query token
    seq_lens: torch.Tensor  # [num_reqs] int32, tokens in the cache after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, batch row -> block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64, token -> flat cache slot
    query_start_loc_cpu: list[int]  # host copies for the torch path
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    decode_order: torch.Tensor | None = None  # [num_reqs] int32, rows longest first: decode attention's order


class Attention(nn.Module):
    """Attends over the paged cache. forward takes q when the cache already
    holds this step's keys and values; from_qkv takes the q|k|v projection
    and writes them first (kernels/qkv.py).

    kv_cache is bound by the model runner after it sizes the KV pool:
    [2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.fused_decode = envs.fused_decode()  # from_qkv's decode path (read once, not at every step)

    def forward(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]
        if q.is_cuda:  # Triton kernels
            return paged_attention(q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   self.scale, meta.max_query_len, meta.max_seq_len, order=meta.decode_order)
        return paged_attention_ref(
            q, self.kv_cache, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_tables, self.scale
        )

    def from_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [max_positions, head_dim] float32
        qk_norm: tuple[torch.Tensor | None, torch.Tensor | None, float],  # per-head q, k RMSNorm weights, eps
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """q and k normed (with qk_norm's weights) and rotated, k and v written
        into the cache at meta.slot_mapping, then attention. A decode step on a
        GPU does it all in the decode attention kernel."""
        rope = (positions, cos_sin, *qk_norm, self.kv_cache, meta.slot_mapping, self.num_heads)
        if qkv.is_cuda and meta.max_query_len == 1 and self.fused_decode:
            return decode_attention(qkv, *rope, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                                    meta.max_seq_len, order=meta.decode_order)
        return self(dispatch.rope_and_cache(qkv, *rope), meta)
