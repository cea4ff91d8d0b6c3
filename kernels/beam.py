"""Copying the partial KV blocks beams inherit when they fork: torch reference and Triton kernel.

Each beam of a group holds a block of its own for the partial last block
of its sequence; when beam j continues beam src (another beam), the first
n positions of src's block (every layer, keys and values) are copied into
j's. A beam may be both a parent and a child in one fork, so every read
of a group happens before any write of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def copy_partial_blocks_ref(
    kv: torch.Tensor,  # [layers, 2, num_blocks, block_size, heads, head_dim], changed in place
    src_blocks: torch.Tensor,  # [num_rows] int64, the block each row copies from
    dst_blocks: torch.Tensor,  # [num_rows] int64, the block each row copies into
    num_positions: torch.Tensor,  # [num_rows] int64, leading positions to copy (0 = none)
    group_starts: torch.Tensor,  # [num_groups + 1] int64: group -> its first row (rows of a group are consecutive)
    max_width: int,  # rows of the largest group
) -> None:
    del group_starts, max_width  # the reference reads every row before writing any
    block_size = kv.shape[3]
    keep = torch.arange(block_size, device=kv.device)[None, :] < num_positions[:, None]  # [rows, block_size]
    keep = keep[None, None, :, :, None, None]
    moved = kv[:, :, src_blocks]
    kv[:, :, dst_blocks] = torch.where(keep, moved, kv[:, :, dst_blocks])


# Triton: one program per (group, layer-and-half, chunk of a block's
# elements). A program loads the chunk of every beam of its group into
# registers, then stores them: its reads precede its writes, and no other
# program touches that chunk of that group's blocks.
@triton.jit
def _copy_partial_blocks_kernel(kv_ptr, src_ptr, dst_ptr, num_ptr, starts_ptr, plane_stride, block_elems,
                                pos_elems, W_PAD: tl.constexpr, CHUNK: tl.constexpr):
    g = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    start = tl.load(starts_ptr + g)
    width = tl.load(starts_ptr + g + 1) - start
    beams = tl.arange(0, W_PAD)
    live = beams < width
    src = tl.load(src_ptr + start + beams, mask=live, other=0)
    dst = tl.load(dst_ptr + start + beams, mask=live, other=0)
    n = tl.load(num_ptr + start + beams, mask=live, other=0) * pos_elems
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = live[:, None] & (offs[None, :] < n[:, None])
    base = kv_ptr + plane * plane_stride
    vals = tl.load(base + src[:, None] * block_elems + offs[None, :], mask=mask)
    tl.store(base + dst[:, None] * block_elems + offs[None, :], vals, mask=mask)


def copy_partial_blocks(kv: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor,
                        num_positions: torch.Tensor, group_starts: torch.Tensor, max_width: int) -> None:
    layers, halves, num_blocks, block_size, heads, head_dim = kv.shape
    assert kv.is_contiguous()
    w_pad = triton.next_power_of_2(max_width)
    block_elems = block_size * heads * head_dim
    chunk = max(128, min(triton.next_power_of_2(block_elems), 8192 // w_pad))
    grid = (len(group_starts) - 1, layers * halves, triton.cdiv(block_elems, chunk))
    _copy_partial_blocks_kernel[grid](kv, src_blocks, dst_blocks, num_positions, group_starts,
                                      num_blocks * block_elems, block_elems, heads * head_dim, W_PAD=w_pad,
                                      CHUNK=chunk)
