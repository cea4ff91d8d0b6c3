"""All-reduce over peer GPU memory, for tensor parallelism's small messages.

Each layer ends in two all-reduces of [num_tokens, hidden]; in decode steps
these are a few KiB to a few MiB, where NCCL's fixed cost per call (its
protocol setup and its own synchronisation) is most of the time. Here every
rank allocates one buffer in torch's symmetric memory: each rank maps every
other rank's buffer into its address space (CUDA IPC over NVLink), plus a
pad of per-block signal flags. One kernel does the whole all-reduce
(torch's one-shot): it copies the rank's input into its buffer, waits at a
barrier on the flags until every rank has done so, reads and sums all the
buffers, and waits again so that no rank overwrites its buffer while a peer
still reads it. It is a plain kernel on the current stream, so the step's
CUDA graphs capture it.

Messages larger than the buffer go to NCCL, whose bandwidth wins there.
NVLink multicast is never used: the one-shot kernel reads peers' memory
with ordinary loads (torch's multimem kernels are the ones that need
multicast), and every process headrace starts for tensor parallelism runs
with multicast off in NCCL, torch and NVSHMEM (NO_MULTICAST_ENV).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# Keeps NVLink multicast (NVLS) off in NCCL, torch's symmetric memory and NVSHMEM.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# The largest message that goes through peer memory; NCCL takes larger ones.
# On two H200s (benchmarks/tp_step.py, bfloat16, calls in a CUDA graph) peer
# memory took 6.6 us for 8 KiB against NCCL's 12.1, 21.8 against 33.5 for
# 2 MiB, and 61.8 against 52.0 for 8 MiB.
PEER_MAX_BYTES = 4 * 2**20

_ALIGN = 16  # bytes: the one-shot kernel's widest vector loads, which need the same alignment on every operand


class PeerAllReduce:
    """Sum-all-reduce of bfloat16 or float32 tensors of up to max_bytes over
    the ranks of group, through symmetric memory on device."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = PEER_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the peer-memory all-reduce sums bfloat16 or float32, not {dtype}")
        self.group_name = group.group_name
        try:
            symm_mem.set_backend("CUDA")  # CUDA IPC, not NVSHMEM
        except (AttributeError, RuntimeError):  # older torch: CUDA is the only backend
            pass
        with warnings.catch_warnings():  # needed before torch 2.10, deprecated after
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)  # [max numel]
        # Maps the peers' buffers; held for the buffer's life (the ops find it again by pointer).
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.max_numel = self.buffer.numel()
        self._copy_in_kernel = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype == self.buffer.dtype and 0 < x.numel() <= self.max_numel and x.is_contiguous()
                and nbytes % _ALIGN == 0 and x.storage_offset() * x.element_size() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in a new tensor (x itself is left as it was); x must fit."""
        out = torch.empty_like(x)
        buf = self.buffer[: x.numel()]
        if self._copy_in_kernel:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x.view(-1), "sum", self.group_name, out.view(-1))
        else:
            buf.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out


def try_peer_all_reduce(group, device: torch.device, dtype: torch.dtype, max_bytes: int):
    """A PeerAllReduce, or None with the reason when this machine cannot run
    one (no peer access between the GPUs, a torch without symmetric memory);
    the ranks agree, so that all of them take the same path for every call."""
    peer, reason = None, ""
    try:
        peer = PeerAllReduce(group, device, dtype, max_bytes)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL alone
        reason = f"{type(e).__name__}: {e}"
    ok = torch.tensor([peer is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        return None, reason or "another rank could not set it up"
    return peer, ""
