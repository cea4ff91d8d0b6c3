"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm
that follow it: torch reference and Triton kernel.

Each rank holds a partial sum x (its slice of o_proj or down_proj); the
layer needs s = sum over ranks of x, then residual += s and the RMSNorm of
the new residual. The kernel does all of it in one pass over each row:
each program copies its rows of x into this rank's buffer (mapped into every
rank's address space), meets the same program of every other rank at a
barrier, sums its rows from every rank's buffer in rank order, and then adds
and normalises as kernels/norm.py's fused residual RMSNorm does. A second
barrier keeps each program until its peers have read its rows, so the next
call may overwrite the buffer.

The barrier is a pair of flags per (program, peer) in each rank's signal
pad (uint32, zero when idle): to signal a peer, wait until its flag from us
is 0 and set it to 1 (release, system scope); to wait for a peer, wait
until our flag from it is 1 and set it back to 0 (acquire). Every call
leaves the pad zeroed, so a CUDA graph can replay it.

Rounding matches the unfused path (an all-reduce into x's dtype, then
norm.py's kernel): the sum is taken in float32 and rounded once to x's
dtype, which for two ranks is exactly NCCL's sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.norm import MAX_HIDDEN, cast_rtne, rms_norm_ref


def allreduce_add_rms_norm_ref(
    parts: list[torch.Tensor],  # [num_tokens, hidden] per rank, in rank order
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(sum + residual), sum + residual), sum rounded to the parts' dtype."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        total += p.float()
    return rms_norm_ref(total.to(parts[0].dtype), weight, eps, residual)


@triton.jit
def _signal(pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr, SEM: tl.constexpr):
    """Set our flag `slot` in every rank's pad, waiting while the last one is unread."""
    ranks = tl.arange(0, WORLD)
    flags = tl.load(pads + ranks).to(tl.pointer_type(tl.uint32)) + slot * WORLD + RANK
    done = ranks < 0
    while tl.sum((~done).to(tl.int32), axis=0) > 0:
        # a rank already signalled compares against 2, which no flag holds: no write
        old = tl.atomic_cas(flags, tl.where(done, 2, 0).to(tl.uint32), tl.full([WORLD], 1, tl.uint32),
                            sem=SEM, scope="sys")
        done = done | (old == 0)


@triton.jit
def _wait(pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr, SEM: tl.constexpr):
    """Wait for every rank's flag `slot` in our pad, and clear it."""
    ranks = tl.arange(0, WORLD)
    flags = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32)) + slot * WORLD + ranks
    done = ranks < 0
    while tl.sum((~done).to(tl.int32), axis=0) > 0:
        old = tl.atomic_cas(flags, tl.where(done, 2, 1).to(tl.uint32), tl.zeros([WORLD], tl.uint32),
                            sem=SEM, scope="sys")
        done = done | (old == 1)


@triton.jit
def _barrier(pads, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    tl.debug_barrier()  # every thread's writes before the release
    _signal(pads, slot, RANK, WORLD, "release")
    _wait(pads, slot, RANK, WORLD, "acquire")
    tl.debug_barrier()  # no thread reads before the acquire


@triton.jit
def _allreduce_add_rms_norm_kernel(
    x_ptr,  # [num_rows, hidden] contiguous: this rank's partial sums
    res_ptr,  # [num_rows, hidden] contiguous: read, then overwritten with sum + residual
    w_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden] contiguous
    buffers,  # [WORLD] int64: each rank's buffer's address (x's dtype, >= num_rows * hidden)
    pads,  # [WORLD] int64: each rank's signal pad's address (uint32, >= 2 * programs * WORLD flags)
    num_rows, hidden, eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program p handles rows p, p + P, ... (P programs, at most one an SM, so
    # that every program of every rank is resident at once: program p waits
    # for program p of each peer, which must not wait for a free SM).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty

    mine = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, num_rows, programs):
        at = row * hidden + offs  # int32: the buffers hold less than 2**31 elements
        tl.store(mine + at, tl.load(x_ptr + at, mask=mask, other=0.0), mask=mask)
    _barrier(pads, pid, RANK, WORLD)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, programs):
        at = row * hidden + offs  # int32: the buffers hold less than 2**31 elements
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            part = tl.load(buffers + r).to(tl.pointer_type(dtype))
            total += tl.load(part + at, mask=mask, other=0.0).to(tl.float32)
        s = cast_rtne(total, dtype).to(tl.float32)
        s = cast_rtne(s + tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(res_ptr + at, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
        y = cast_rtne(sf * rstd, dtype).to(tl.float32)
        tl.store(out_ptr + at, cast_rtne(w * y, out_ptr.dtype.element_ty), mask=mask)
    # Peers read our rows above: none may leave (and a next call overwrite them) before all have.
    _barrier(pads, programs + pid, RANK, WORLD)


def allreduce_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] contiguous, this rank's part
    residual: torch.Tensor,  # [num_tokens, hidden] contiguous, x's dtype; overwritten
    weight: torch.Tensor,  # [hidden] contiguous
    eps: float,
    buffers: torch.Tensor,  # [world_size] int64 on x's device: the ranks' buffer addresses
    pads: torch.Tensor,  # [world_size] int64 on x's device: the ranks' signal pad addresses
    rank: int,
    world_size: int,
    max_programs: int,  # at most the device's SMs, and what the signal pads hold (2 * WORLD flags a program)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of allreduce_add_rms_norm_ref, every rank calling it with
    the same shapes: returns (normalised, residual), residual updated in place."""
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape and x.dim() == 2
    assert residual.dtype == x.dtype and weight.shape == (x.shape[1],) and x.shape[1] <= MAX_HIDDEN
    num_rows, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if num_rows:
        block = triton.next_power_of_2(hidden)
        _allreduce_add_rms_norm_kernel[(min(num_rows, max_programs),)](
            x, residual, weight, out, buffers, pads, num_rows, hidden, eps,
            RANK=rank, WORLD=world_size, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out, residual
