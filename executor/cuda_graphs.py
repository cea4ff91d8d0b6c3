"""CUDA graphs for every step: the model's forward captured once per padded
shape, replayed from static input buffers, so that a step costs the host one
launch instead of a few hundred.

The graphs read the step's inputs where input preparation writes them
(executor/input_batch.py's InputBuffers), so a replay copies nothing in.
Decode steps (one query a row) of n rows run the decode graph of the
smallest captured size b >= n; rows n..b-1 are padding (slot -1, so nothing
is written to the KV cache, and a one-token context) whose outputs are
dropped. Other steps (prefill chunks, alone or beside decoding rows) of t
tokens run the mixed graph of the smallest captured token count T >= t,
captured for min(max_num_seqs, T) rows: tokens t..T-1 belong to no row
(slot -1; their outputs are dropped) and rows past the batch are empty
(query_start_loc stays at t), which both attention kernels skip. Attention
is captured with bounds that hold for any step (max_seq_len =
max_model_len; a mixed graph's max_query_len = T), so one graph serves
every context length and layout.

A decode graph's rows can also be sampled by a graph of their own
(capture_sampling: the LM head, the sampling kernel and the slots' advance),
so that a step whose rows all sample straight from their logits costs the
host two launches in all; other steps sample eagerly from the same output.

Every graph captured here launches its Triton kernels with programmatic
dependent launch (kernels/device.py: pdl). On an H100, capturing even one
graph with no such kernel (a lone add_, or the sampling graph before its
kernels used PDL) stopped the decode graphs' kernels from overlapping each
other's launch: a 64-row step at context 1024 took about 110 us longer, as
with HEADRACE_PDL=0 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import bisect
import weakref

import torch

from headrace.executor.attention import AttentionMetadata
from headrace.executor.input_batch import InputBatch, InputBuffers


# Every StepGraphs alive in this process. Its captured matmuls use the cuBLAS
# workspace torch keeps for (handle, its capture stream): torch's workspaces
# may be cleared only while none is alive.
_live: weakref.WeakSet = weakref.WeakSet()


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps for each (thread's handle,
    stream) pair it has run a matmul on (32 MiB each on Hopper), unless CUDA
    graphs still use one; torch allocates them again when next needed."""
    if not _live:
        torch._C._cuda_clearCublasWorkspaces()


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Rows of the decode graphs."""
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def mixed_token_counts(max_num_batched_tokens: int) -> list[int]:
    """Tokens of the mixed graphs: 32, 48, 64, 96, ... (steps of 1.5x and
    4/3x, every one a multiple of 16), up to max_num_batched_tokens, so a
    step computes at most half again its tokens."""
    sizes, s = [], 32
    while s < max_num_batched_tokens:
        sizes.append(s)
        s = s * 3 // 2 if s & (s - 1) == 0 else s * 4 // 3
    return sizes + [max_num_batched_tokens]


def logit_rows(sizes: list[int], n: int) -> int:
    """Rows the LM head runs at for n sampling rows: the smallest of sizes (sorted) >= n, else n. cuBLAS
    picks a kernel the first time it meets a row count (about 1.7 ms on an H100), so with padded rows a run
    meets at most len(sizes) counts, each first met during capture, rather than every count from 1 up."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


class StepGraphs:
    def __init__(self, model, bufs: InputBuffers, max_num_batched_tokens: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.bufs = bufs  # the step's inputs, written there by input preparation: nothing is copied in
        S = bufs.rows
        self.decode_starts = torch.arange(S + 1, dtype=torch.int32, device=device)  # [S + 1]: one query a row
        self.decode: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # rows -> graph, output
        self.mixed: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # tokens -> graph, output
        self.sampling: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # rows -> graph, tokens
        self.max_rows = S
        self.pool = torch.cuda.graph_pool_handle()  # shared by every graph here: replayed one at a time
        # A captured matmul bakes in the cuBLAS workspace of the stream it was
        # captured on. Every warm-up and capture runs on this engine's own
        # stream, whose workspace torch keeps (and clear_cublas_workspaces
        # leaves alone) while these graphs live; another engine's captures
        # bake in their own stream's.
        self.stream = torch.cuda.Stream(device)
        _live.add(self)
        with torch.inference_mode():
            # Largest first: the smaller ones reuse its pool.
            for tokens in sorted(mixed_token_counts(max_num_batched_tokens), reverse=True):
                self.mixed[tokens] = self._capture(tokens, self._mixed_meta(tokens))
            for rows in sorted(capture_sizes(S), reverse=True):
                self.decode[rows] = self._capture(rows, self._decode_meta(rows))
        self._decode_sizes, self._mixed_sizes = sorted(self.decode), sorted(self.mixed)  # for bisect
        with torch.inference_mode():
            for rows in self._decode_sizes:  # the LM head's first call at each padded row count
                model.compute_logits(self.decode[rows][1], upcast=False)

    def logit_rows(self, n: int) -> int:
        """Rows the LM head runs at for n sampling rows (module-level logit_rows over the decode sizes)."""
        return logit_rows(self._decode_sizes, n)

    def _decode_meta(self, n: int) -> AttentionMetadata:
        b = self.bufs
        return AttentionMetadata(
            query_start_loc=self.decode_starts[: n + 1], seq_lens=b.seq_lens[:n],
            block_tables=b.block_tables[:n], slot_mapping=b.slot_mapping[:n],
            query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=1, max_seq_len=self.max_model_len,
            decode_order=b.decode_order[:n],
        )

    def _mixed_meta(self, tokens: int) -> AttentionMetadata:
        rows, b = min(self.max_rows, tokens), self.bufs
        return AttentionMetadata(
            query_start_loc=b.query_start_loc[: rows + 1], seq_lens=b.seq_lens[:rows],
            block_tables=b.block_tables[:rows], slot_mapping=b.slot_mapping[:tokens],
            query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=tokens, max_seq_len=self.max_model_len,
            decode_order=b.decode_order[:rows],
        )

    def _capture(self, tokens: int, meta: AttentionMetadata) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Captured with every row empty (or, for decode, writing nothing), so
        # the warm-up runs touch no cache.
        args = (self.bufs.input_ids[:tokens], self.bufs.positions[:tokens], meta)
        return self._capture_fn(lambda: self.model(*args))

    def _capture_fn(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: Triton compiles and autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return graph, out

    def capture_sampling(self, sample) -> None:
        """For each decode size b, a graph of sample(hidden [b, H] (the decode graph's output), b) -> [b]
        tokens. It runs after the decode graph and must leave padding rows' state alone (the buffers
        say the step's row count: query_start_loc[b]). Captured while every row is padding, so the
        warm-up runs change nothing."""
        with torch.inference_mode():
            for rows in reversed(self._decode_sizes):
                hidden = self.decode[rows][1]
                self.sampling[rows] = self._capture_fn(lambda: sample(hidden, rows))

    def fits(self, batch: InputBatch) -> bool:
        """Whether a graph is large enough. Rows always fit: a step has at most
        max_num_seqs rows and no more rows than tokens, as the mixed graphs do."""
        sizes = self._decode_sizes if batch.attn.max_query_len == 1 else self._mixed_sizes
        return int(batch.query_start_loc_np[-1]) <= sizes[-1]

    def run(self, batch: InputBatch) -> torch.Tensor:  # [size, hidden], size >= num_tokens
        """Replay the graph for the batch, which input preparation wrote into
        this graph's buffers (prepare_inputs with bufs); only padding tokens
        past it get their slot set to -1 here. Returns the graph's whole
        output: the rows past the batch's tokens are padding."""
        meta = batch.attn
        t = int(batch.query_start_loc_np[-1])  # a decode step's t is its row count
        if batch.input_ids.data_ptr() != self.bufs.input_ids.data_ptr():
            raise RuntimeError("the batch was not prepared in the CUDA graphs' input buffers")
        decode = meta.max_query_len == 1
        sizes = self._decode_sizes if decode else self._mixed_sizes
        size = sizes[bisect.bisect_left(sizes, t)]
        if size > t:  # padding tokens write nothing; padding rows' seq_lens and starts came packed
            self.bufs.slot_mapping[t:size].fill_(-1)
        graph, out = (self.decode if decode else self.mixed)[size]
        graph.replay()
        return out

    def run_sampled(self, batch: InputBatch) -> torch.Tensor:  # [num_rows] int64
        """A decode step through its graph, then the sampling graph of the same size (capture_sampling):
        the rows' tokens, the slots already advanced on the device."""
        size = self.run(batch).shape[0]
        graph, tokens = self.sampling[size]
        graph.replay()
        return tokens[: len(batch.req_ids)]

    def samples(self, batch: InputBatch) -> bool:
        """Whether run_sampled can take the step: a decode step a graph fits, with sampling captured."""
        return bool(self.sampling) and batch.attn.max_query_len == 1 and self.fits(batch)
