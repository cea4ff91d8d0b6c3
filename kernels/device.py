"""Facts about the device that launchers size their grids by."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from headrace import envs


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; off the GPU an H100's 132
    stand in, so the interpreter makes the choices the GPU would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on device launch with programmatic dependent launch: the
    next kernel is started while this one ends, and waits (gdc_wait) before it
    reads or writes memory. Hopper and later, unless HEADRACE_PDL=0."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and envs.pdl()


@functools.cache
def pdl_args(device: torch.device) -> dict:
    """The launch arguments of a kernel that starts with wait_for_previous: its PDL
    constexpr, and launch_pdl where pdl() holds. Shared: never modified."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL: pdl() held at launch), wait until the
    kernel before has finished and its writes are visible, then let the next kernel
    start its launch. A kernel calls this before it writes any memory, and before it
    reads any that the kernel before may write. What no kernel writes (weights), and
    what a kernel at least two back wrote (the step's inputs, which input preparation
    writes), it may read first, overlapping the previous kernel's tail: a kernel
    starts only once the one two back has ended (the kernel before lets it launch
    after its own wait, or started after that one ended)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# cp.async.bulk.prefetch.L2 asks L2 for a run of bytes and returns at once; a lane whose size is 0 issues
# nothing. inline_asm_elementwise must return a value: the register is unused.
_PREFETCH = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                         "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask L2 for nbytes (int32, a multiple of 16; 0: none) at each of ptrs (16-byte aligned); sm_90 and later
    only. A kernel's first weight tiles, asked for before wait_for_previous, arrive while the kernel before ends."""
    tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [ptrs.to(tl.pointer_type(tl.int8)), nbytes], dtype=tl.int32,
                              is_pure=False, pack=1)
