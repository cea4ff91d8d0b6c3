"""CUDA graphs for decode steps: the model's forward captured once per padded
batch size, replayed from static input buffers.

A decode-only batch of n rows runs the graph of the smallest captured size
b >= n; rows n..b-1 are padding (slot -1, so nothing is written to the KV
cache, and a one-token context) whose outputs are dropped. The attention
kernels are captured with max_seq_len = max_model_len, an upper bound, so
one graph serves every context length.
"""
from __future__ import annotations

import torch

from headrace.executor.attention import AttentionMetadata
from headrace.executor.input_batch import InputBatch


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps for each (thread's handle,
    stream) pair it has run a matmul on (32 MiB each on Hopper); torch
    allocates them again when next needed."""
    torch._C._cuda_clearCublasWorkspaces()


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_req: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.max_model_len = max_model_len
        S = max_num_seqs
        self.input_ids = torch.zeros(S, dtype=torch.long, device=device)  # [S]
        self.positions = torch.zeros(S, dtype=torch.long, device=device)  # [S]
        self.slot_mapping = torch.full((S,), -1, dtype=torch.long, device=device)  # [S] row -> cache slot
        self.seq_lens = torch.ones(S, dtype=torch.int32, device=device)  # [S]
        self.block_tables = torch.zeros(S, max_blocks_per_req, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(S + 1, dtype=torch.int32, device=device)  # one query a row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # A captured matmul bakes in the cuBLAS workspace of the capture stream.
        # Cleared before, that workspace is allocated during the capture, in
        # this pool, and lives as long as these graphs; cleared after, no later
        # capture (another engine's) bakes in a workspace that dies with ours,
        # and the warm-up streams' workspaces are freed.
        clear_cublas_workspaces()
        with torch.inference_mode():
            for size in sorted(capture_sizes(S), reverse=True):  # largest first: later ones reuse its pool
                self.graphs[size] = self._capture(size, pool)
        clear_cublas_workspaces()

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], slot_mapping=self.slot_mapping[:n],
            query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=self.max_model_len,
        )

    def _capture(self, n: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.input_ids[:n], self.positions[:n], self._meta(n))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(*args)
        return graph, out

    def fits(self, batch: InputBatch) -> bool:
        return batch.attn.max_query_len == 1 and len(batch.req_ids) <= max(self.graphs)

    def run(self, batch: InputBatch) -> torch.Tensor:  # [num_rows, hidden]
        n = len(batch.req_ids)
        size = min(s for s in self.graphs if s >= n)
        meta = batch.attn
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n].copy_(meta.block_tables)
        if size > n:  # padding rows: write nothing, attend to one (ignored) key
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
