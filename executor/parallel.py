"""Tensor parallelism: one rank's place in its group, the collectives the
model needs, and which slice of each weight a rank holds.

Sharding (Megatron-style, N ranks):
- attention: query heads split evenly; KV heads split evenly, or, when there
  are fewer KV heads than ranks, each rank holds the one its query heads
  read (replicated across N / num_kv_heads ranks); o_proj takes its rank's
  columns and its outputs are summed over ranks (all-reduce).
- MLP: gate and up split by rows (column-parallel), down_proj by columns
  (row-parallel), then summed.
- embedding and LM head: split by vocabulary rows, ceil(vocab / N) each
  (the last padded with zero rows); an embedding lookup outside a rank's
  rows is zero there and the ranks' lookups are summed; logits are gathered
  along the vocabulary and cut to its size.
- A row-parallel bias is held by rank 0 alone (zeros elsewhere), so the sum
  adds it once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.executor.all_reduce import PeerAllReduce, try_peer_all_reduce

logger = logging.getLogger("headrace.executor")


@dataclass(frozen=True)
class TPGroup:
    """This process's rank among size ranks; group is the torch.distributed
    process group (None for one rank, when every collective is a no-op);
    peer, when set, sums the messages it fits through peer GPU memory
    (executor/all_reduce.py), and NCCL (or gloo) the rest."""

    rank: int = 0
    size: int = 1
    group: object = None
    peer: PeerAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks: x itself (reduced in place) or a new tensor."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.fits(x):
            return self.peer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n] in dtype, rank 0's
        columns first. The ranks' parts travel in x's dtype (half the bytes
        of float32 logits from a bfloat16 model) and are laid out and cast
        in one copy."""
        x = x.contiguous()
        rows, n = x.shape
        if x.is_cuda:
            parts = torch.empty((self.size, rows, n), dtype=x.dtype, device=x.device)  # [rank, row, column]
            dist.all_gather_into_tensor(parts, x, group=self.group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            parts = torch.stack(parts)
        out = torch.empty((rows, self.size * n), dtype=dtype, device=x.device)
        out.view(rows, self.size, n).copy_(parts.permute(1, 0, 2))
        return out

    def min_int(self, value: int, device: torch.device) -> int:
        """The least of value over all ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming the dimension, a model that size ranks cannot split evenly."""
    if size == 1:
        return
    if cfg.num_heads % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={size} neither divides nor is a multiple of the model's "
                          f"{cfg.num_kv_heads} KV heads")
    if cfg.intermediate_size % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the MLP's intermediate size "
                          f"{cfg.intermediate_size}")


def local_kv_heads(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int]:
    """(the first KV head this rank holds, how many)."""
    if cfg.num_kv_heads % tp.size == 0:
        n = cfg.num_kv_heads // tp.size
        return tp.rank * n, n
    return tp.rank * cfg.num_kv_heads // tp.size, 1


def vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(first row, rows per rank) of the vocabulary-parallel embedding and LM head."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


def init_group(rank: int, size: int, init_file: str, device: torch.device, dtype: torch.dtype | None = None,
               peer_bytes: int = 0) -> TPGroup:
    """Join the group of size ranks that meet through init_file (NCCL on
    CUDA, gloo on the CPU). On GPUs, with peer_bytes, messages of dtype up to
    that size are summed through peer memory where the machine allows it
    (the ranks agree; otherwise NCCL takes them all, and the log says why)."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size, **kwargs)
    group, peer = dist.group.WORLD, None
    if device.type == "cuda" and peer_bytes:  # PeerAllReduce refuses, naming it, a dtype it cannot sum
        peer, reason = try_peer_all_reduce(group, device, dtype, peer_bytes)
        if rank == 0:
            if peer is None:
                logger.warning("tensor parallel: every all-reduce goes through NCCL (no peer-memory all-reduce: %s)",
                               reason)
            else:
                logger.info("tensor parallel: all-reduces of up to %d KiB through peer memory, NCCL above",
                            peer_bytes // 1024)
    return TPGroup(rank, size, group, peer)
