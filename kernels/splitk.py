"""Split-K in one launch, for the few-rows GEMM kernels.

When K is split, every program of an output tile stores its float32 partial
sum; the last of the tile's programs to finish (an atomic count per tile)
adds the partials in split order, so results are the same run to run, and
resets the count to zero for the next call. A layer keeps its own counts
(counters()): calls that share them must run one after another on one stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.device import num_sms

UNROLLED_SUM = 16  # up to this many splits sum_splits' last program loads the partials at once (max_splits)


def counters(tiles: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counts for a kernel of up to `tiles` output tiles."""
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def counters_for(count: torch.Tensor | None, tiles: int, device: torch.device) -> torch.Tensor:
    """`count` if it has room for `tiles`, else a fresh zeroed one (tests and benchmarks pass none)."""
    return count if count is not None and count.numel() >= tiles else counters(tiles, device)


@triton.jit
def sum_splits(acc, part_ptr, count_ptr, tile, split, num_splits, split_stride, offs, mask,
               MAX_SPLITS: tl.constexpr = 0):
    """acc [BLOCK_M, BLOCK_N] float32: this program's partial, stored at
    part_ptr + split * split_stride + offs -> (the tile's sum over every split,
    whether this program is the one to write it). MAX_SPLITS (a power of two at
    least num_splits, or 0): the last program issues its loads of the partials
    all at once rather than one after another."""
    tl.store(part_ptr + split * split_stride + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the count says so
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == num_splits - 1
    total = acc
    if last:
        total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if MAX_SPLITS:
            for s in tl.static_range(1, MAX_SPLITS):
                src = tl.minimum(num_splits - 1, s)  # past the last split: one already added, dropped below
                more = tl.load(part_ptr + src * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
                total += tl.where(src == s, more, 0.0)
        else:
            for s in range(1, num_splits):
                total += tl.load(part_ptr + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
    return total, last


def max_splits(splits: int) -> int:
    """sum_splits' MAX_SPLITS for a launch of `splits` splits: loads at once up to UNROLLED_SUM, else in turn."""
    return triton.next_power_of_2(splits) if splits <= UNROLLED_SUM else 0


def plan(tiles: int, k: int, block_k: int, shape: tuple[int, int], out: torch.Tensor, counts: torch.Tensor | None,
         programs_per_sm: int = 2, splits: int = 0,
         whole_k_tiles: int = 0) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """Split K so that tiles x splits programs fill about programs_per_sm a
    multiprocessor (or into about `splits` runs, if given: tests and
    benchmarks), leaving K whole where there are whole_k_tiles tiles an SM or
    more (if given): (K elements a split, splits, the float32 partials [splits,
    *shape], the counters). With one split, out stands in for both."""
    if not splits and whole_k_tiles and tiles >= whole_k_tiles * num_sms(out.device):
        splits = 1
    slices = triton.cdiv(k, block_k)
    wanted = splits or triton.cdiv(programs_per_sm * num_sms(out.device), tiles)
    per_split = triton.cdiv(slices, min(slices, wanted))
    splits = triton.cdiv(slices, per_split)
    if splits == 1:
        return per_split * block_k, 1, out, out
    part = torch.empty((splits, *shape), dtype=torch.float32, device=out.device)
    return per_split * block_k, splits, part, counters_for(counts, tiles, out.device)
