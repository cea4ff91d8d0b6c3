"""The model runner: slots, staged writes, the model and the sampler, one step at a time."""
from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from headrace import envs
from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.config import EngineArgs, SchedulerConfig
from headrace.executor.attention import AttentionMetadata
from headrace.executor.beam import BeamState, fork_beams, select_beams
from headrace.executor.cuda_graphs import StepGraphs, clear_cublas_workspaces
from headrace.executor.input_batch import InputBatch, InputBuffers, prepare_inputs
from headrace.executor.logits_processors import load_logits_processors
from headrace.executor.models.loader import load_model
from headrace.executor.models.quant import resolve_quantization
from headrace.executor.parallel import TPGroup, local_kv_heads
from headrace.executor.sampler import SampledLogprobs, plain_rows, sample, sample_by_slot
from headrace.executor.sampling_state import SamplingState
from headrace.executor.states import RequestStates
from headrace.kernels import dispatch
from headrace.step import BeamCandidates, SchedulerOutput


@dataclass
class PromptLogprobs:
    """Prompt positions computed this step: row i scores prompt token start + i + 1."""

    start: int
    token_ids: np.ndarray  # [m, 1 + k] int64: the prompt token, then the top-k
    scores: np.ndarray  # [m, 1 + k] float32, after act_func
    ranks: np.ndarray  # [m] int64, the prompt token's rank


@dataclass
class PendingOutput:
    """A step queued on the device; ModelRunner.collect() reads it back."""

    req_ids: list[str]  # batch order
    slots: np.ndarray  # [num_rows] batch row -> slot when queued
    sample_rows: np.ndarray  # rows that sample a token
    sampled: torch.Tensor  # [num_rows] int64, host copy (valid after `ready`)
    logprobs: tuple[torch.Tensor, torch.Tensor] | None  # host copies of the packed logprobs
    prompt_logprobs: dict[str, tuple]  # request id -> (start, token ids, scores, ranks), host copies
    beams: tuple | None = None  # host copies of select_beams()' candidates (and their logprobs)
    ready: torch.cuda.Event | None = None  # passed when the host copies are done (None on the CPU)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    sampled_token_ids: list[int]  # batch row -> sampled token (meaningless for prefill-chunk rows)
    logprobs: SampledLogprobs | None
    prompt_logprobs: dict[str, PromptLogprobs]  # request id -> this step's prompt positions
    beams: BeamCandidates | None = None  # the beam groups' candidates, in the step's beam_selects order


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes one KV block takes over all layers (num_kv_heads: those one rank holds; default all)."""
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * dtype.itemsize


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def first_gpu(device: torch.device, offset: int, count: int, what: str) -> int:
    """The index of the first of count GPUs that start offset GPUs after
    device; refuses, naming them and what needs them, GPUs this machine lacks."""
    first = (device.index or 0) + offset
    have = torch.cuda.device_count()
    if first + count > have:
        wanted = f"cuda:{first}" if count == 1 else f"cuda:{first} to cuda:{first + count - 1}"
        raise ConfigError(f"{what} needs {wanted}, but this machine has {have} GPU(s)")
    return first


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype (float32 when config.json names none),
    except that a float32 checkpoint runs in bfloat16 on a GPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cpu" and checkpoint_dtype == "float32":
        return torch.bfloat16
    return getattr(torch, checkpoint_dtype)


def on_device(method):
    """Run a ModelRunner method with the runner's GPU as the current device:
    Triton launches, CUDA graph captures, events and new streams all go to
    the current device, whatever GPU their tensors are on. A process may hold
    runners on several GPUs, so each call sets it, not just the first."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class ModelRunner:
    """One rank's runner: under tensor parallelism every rank runs one, in
    lockstep, on the same inputs (executor/workers.py)."""

    def __init__(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig, args: EngineArgs,
                 tp: TPGroup = TPGroup(), lap: Callable[[str], None] = lambda phase: None) -> None:
        self.lap = lap  # called as each phase of _build ends (the core times them: EngineCore.startup)
        self.device = resolve_device(args.device)
        if self.device.type != "cuda":
            self._build(model_cfg, sched_cfg, args, tp)
            return
        with torch.cuda.device(self.device):
            try:
                self._build(model_cfg, sched_cfg, args, tp)
            except torch.OutOfMemoryError as e:
                self.close()
                free, total = torch.cuda.mem_get_info(self.device)
                raise ConfigError(
                    f"{self.device} ({torch.cuda.get_device_name(self.device)}) ran out of memory while the engine "
                    f"was starting ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free now): lower max_model_len, "
                    f"max_num_seqs or max_num_batched_tokens, or use more GPUs ({str(e).splitlines()[0]})") from None

    def _build(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig, args: EngineArgs, tp: TPGroup) -> None:
        self.closed = False
        self.model = self.graphs = self.bufs = self.kv = None
        self.kv_caches = []
        self.states = None
        self.processors = []
        self.tp = tp
        if self.device.type == "cpu" and args.gpu_memory_utilization != 0.9:
            raise ConfigError("gpu_memory_utilization applies to a GPU; on the CPU the KV pool is sized by "
                              "num_kv_blocks or HEADRACE_CPU_KV_CACHE_GB")
        if self.device.type == "cpu":
            # torch's OpenMP workers spin at barriers; with the engine's own
            # threads competing for the same cores, steps slow down severalfold.
            # Tensor-parallel ranks share the CPUs.
            torch.set_num_threads(max(1, envs.cpu_threads() // tp.size))
        self.dtype = resolve_dtype(args.dtype, model_cfg.checkpoint_dtype, self.device)
        self.block_size = args.block_size
        self.quant = resolve_quantization(args, model_cfg, self.device, self.dtype, tp.size)
        self.model = load_model(model_cfg, self.dtype, self.device, sched_cfg.max_model_len, tp, self.quant)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the temporaries of quantizing at load, for the KV pool
        self.lap("weights")
        self.num_kv_heads = local_kv_heads(model_cfg, tp)[1]  # this rank's
        self.num_blocks = tp.min_int(self._num_blocks(model_cfg, sched_cfg, args), self.device)  # ranks agree
        self.lap("memory profile")
        layers = self.model.attention_layers()
        # One tensor for every layer's cache, so that a beam fork copies a
        # block of all layers in one operation.
        self.kv = torch.zeros((len(layers), 2, self.num_blocks, self.block_size, self.num_kv_heads,
                               model_cfg.head_dim), dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv.unbind(0))
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache
        max_blocks_per_req = -(-sched_cfg.max_model_len // self.block_size)
        sampling = SamplingState(sched_cfg.max_num_seqs, model_cfg.vocab_size, model_cfg.eos_token_ids,
                                 args.logprobs_mode == "processed", self.device)
        self.states = RequestStates(sched_cfg.max_num_seqs, sched_cfg.max_model_len, max_blocks_per_req,
                                    self.device, sampling)
        self.beam = BeamState(sched_cfg.max_num_seqs, self.device)
        self.processors = [make(model_cfg.vocab_size, self.device) for make in load_logits_processors(args)]
        self.lap("kv pool and slots")
        self.graphs = self.bufs = None
        if self.device.type == "cuda" and not args.enforce_eager:
            S = sched_cfg.max_num_seqs
            self.bufs = InputBuffers(S, max(sched_cfg.max_num_batched_tokens, S), max_blocks_per_req, self.device)
            self.graphs = StepGraphs(self.model, self.bufs, sched_cfg.max_num_batched_tokens,
                                     sched_cfg.max_model_len, self.device)
            # Under tensor parallelism the LM head's gather stays out of the sampling graphs.
            if tp.size == 1 and envs.sampling_graphs():
                self.graphs.capture_sampling(self._sample_decode)
            self.lap("cuda graphs")

    @on_device
    def close(self) -> None:
        """Drop every device tensor this runner holds (weights, KV cache, CUDA
        graphs and their pool, slot and sampling state) and hand the memory
        back to the device, so that the next engine in this process sizes its
        KV pool from it. The slots' host bookkeeping stays readable; work is
        refused. Closing twice is harmless."""
        if self.closed:
            return
        self.closed = True
        self.model = self.graphs = self.bufs = self.kv = self.beam = None
        self.kv_caches = []
        if self.states is not None:
            self.states.drop_device_tensors()
        self.processors = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()  # tensors held only by reference cycles
            clear_cublas_workspaces()
            torch.cuda.empty_cache()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine has been shut down")

    def _num_blocks(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig, args: EngineArgs) -> int:
        per_seq = -(-sched_cfg.max_model_len // self.block_size)
        if args.num_kv_blocks is not None:
            if args.num_kv_blocks < per_seq:
                raise ConfigError(
                    f"num_kv_blocks={args.num_kv_blocks} cannot hold one sequence of max_model_len="
                    f"{sched_cfg.max_model_len} tokens ({per_seq} blocks of {self.block_size}); "
                    f"raise num_kv_blocks or lower max_model_len"
                )
            return args.num_kv_blocks
        block_bytes = kv_block_bytes(model_cfg, self.block_size, self.dtype, self.num_kv_heads)
        if self.device.type == "cpu":
            budget = envs.cpu_kv_cache_gb() * 2**30
        else:
            # gpu_memory_utilization of the card, less what is in use (weights)
            # and the peak a full step's activations take.
            free, total = torch.cuda.mem_get_info(self.device)
            activations = self._profile_activation_bytes(model_cfg, sched_cfg)
            in_use = torch.cuda.memory_allocated(self.device)
            budget = min(args.gpu_memory_utilization * total - in_use, free) - activations
        num_blocks = min(per_seq * sched_cfg.max_num_seqs, int(budget // block_bytes))
        if num_blocks < per_seq:
            raise ConfigError(
                f"the KV memory budget ({budget / 2**30:.2f} GiB) cannot hold one sequence of "
                f"max_model_len={sched_cfg.max_model_len} tokens; lower max_model_len"
            )
        return num_blocks

    @on_device
    def remove(self, req_ids) -> None:
        """Free the slots of requests that left (finished, aborted, preempted)."""
        self.check_open()
        for req_id in req_ids:
            slot = self.states.remove(req_id)
            if slot is not None:
                for proc in self.processors:
                    proc.remove_request(slot)

    @torch.inference_mode()
    def _profile_activation_bytes(self, model_cfg: ModelConfig, sched_cfg: SchedulerConfig) -> int:
        """Peak device memory of a forward over max_num_batched_tokens tokens
        (split into requests of at most max_model_len), plus room for the
        sampler's logits of max_num_seqs rows and a sort of them."""
        dev, bs = self.device, self.block_size
        total = sched_cfg.max_num_batched_tokens
        lens = [min(sched_cfg.max_model_len, total - i) for i in range(0, total, sched_cfg.max_model_len)]
        blocks = [-(-n // bs) for n in lens]
        cache = torch.empty(2, sum(blocks), bs, self.num_kv_heads, model_cfg.head_dim, dtype=self.dtype,
                            device=dev)
        layers = self.model.attention_layers()
        for layer in layers:
            layer.kv_cache = cache  # one scratch cache serves every layer here
        table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=dev)
        start = 0
        for i, nb in enumerate(blocks):
            table[i, :nb] = torch.arange(start, start + nb, dtype=torch.int32, device=dev)
            start += nb
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        slots = torch.cat([(table[i, torch.arange(n, device=dev) // bs].long() * bs + torch.arange(n, device=dev) % bs)
                           for i, n in enumerate(lens)])
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=table,
            slot_mapping=slots, query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lens,
            max_query_len=max(lens), max_seq_len=max(lens),
            decode_order=torch.arange(len(lens), dtype=torch.int32, device=dev),  # as every step has one
        )
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        hidden = self.model(torch.zeros(total, dtype=torch.long, device=dev), positions, meta)
        rows = min(total, sched_cfg.max_num_seqs)
        logits = self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del hidden, logits, cache
        for layer in layers:
            layer.kv_cache = None
        torch.cuda.empty_cache()
        return peak + 3 * rows * model_cfg.vocab_size * 4  # sort values and int64 indices

    @on_device
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> PendingOutput:
        """Queue one step on the device and return without waiting for it.

        Everything the next step needs stays on the device: the slots'
        computed counts advance there, and each sampled token is written into
        its slot's token ids, where the next step's input gathering reads it.
        Host copies of the outputs are queued behind the step; collect()
        waits for them.
        """
        self.check_open()
        states = self.states
        self.remove(sched.finished_req_ids)
        for new in sched.new_reqs:
            slot = states.add(new)
            for proc in self.processors:
                proc.add_request(slot, new.sampling_params, new.token_ids[: new.num_prompt_tokens])
            if new.sampling_params.use_beam_search:
                self.beam.add(slot, new)
        for cached in sched.cached_reqs:
            states.update(cached)
        states.apply_staged()
        self.beam.apply_staged()
        if sched.beam_forks:
            fork_beams(sched.beam_forks, states.req_to_slot, self.beam, states.token_ids.gpu, states.block_table.gpu,
                       self.kv, self.block_size)

        batch = prepare_inputs(states, sched.num_scheduled_tokens, self.block_size, self.device, self.bufs)
        if (self.graphs is not None and not sched.beam_selects and self.graphs.samples(batch)
                and len(batch.sample_rows_np) == len(batch.req_ids)
                and plain_rows(batch.idx_mapping_np, states.sampling, self.processors)):
            sampled = self.graphs.run_sampled(batch)  # the slots advanced there too
            self._advance(batch, None)
            return self._pending(batch, sampled, None, {}, None)
        padded = None  # a CUDA graph's whole output: its rows past the batch's tokens are padding
        if self.graphs is not None and self.graphs.fits(batch):
            padded = self.graphs.run(batch)
            hidden = padded[: int(batch.query_start_loc_np[-1])]
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        logits = self._logits(batch, hidden, padded)
        sampled, logprobs = sample(logits, batch, states, self.processors)
        beams = None
        if sched.beam_selects:
            beams = select_beams(logits.float(), batch, states, self.beam, sched.beam_selects)
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        self._advance(batch, sampled)
        return self._pending(batch, sampled, logprobs, prompt_logprobs, beams)

    def _pending(self, batch, sampled, logprobs, prompt_logprobs, beams) -> PendingOutput:
        """Queue the host copies of a step's outputs, and the event that says they are done."""
        pending = PendingOutput(
            req_ids=batch.req_ids,
            slots=batch.idx_mapping_np,
            sample_rows=batch.sample_rows_np,
            sampled=_to_host(sampled),
            logprobs=None if logprobs is None else tuple(map(_to_host, logprobs)),
            prompt_logprobs={rid: (start, *map(_to_host, arrays)) for rid, (start, *arrays) in prompt_logprobs.items()},
            beams=None if beams is None else tuple(None if t is None else _to_host(t) for t in beams),
        )
        if self.device.type == "cuda":
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        return pending

    def _sample_decode(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:  # [rows] int64
        """What a decode graph's sampling graph runs (StepGraphs.capture_sampling) on hidden [rows, H]: the
        LM head, sample_by_slot from the step's buffers, and the slots' advance for the step's rows."""
        b = self.bufs
        logits = self.model.compute_logits(hidden, upcast=False)
        idx = b.views["idx_mapping"][:rows]
        sampled = sample_by_slot(logits, idx, b.views["sample_positions"][:rows], self.states.sampling)
        dispatch.advance_slots(idx, b.seq_lens[:rows], b.views["sample_rows"][:rows], sampled,
                               self.states.num_computed.gpu, self.states.token_ids.gpu,
                               num_rows=b.query_start_loc[rows])
        return sampled

    def _logits(self, batch: InputBatch, hidden: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        """The LM head on each row's last hidden state -> [rows, vocab] in the head's dtype. With CUDA graphs
        its rows are padded up to a decode graph's size (StepGraphs.logit_rows), so that it meets only row
        counts seen at capture. The padded rows are read where they already are: a decode graph's output has
        that size (a decode step past the graphs has more rows than any, so no padding), and a step with a
        prefill chunk, always prepared in the graphs' buffers, gathers through logits_indices, zero past its
        rows (row 0 stands in)."""
        n, decode = len(batch.req_ids), batch.attn.max_query_len == 1
        if self.graphs is None:
            last = hidden if decode else hidden[batch.logits_indices]
        elif decode:  # a decode graph's rows are the decode size logit_rows(n) picks
            last = hidden if padded is None else padded
        elif batch.logits_indices.data_ptr() != self.bufs.logits_indices.data_ptr():
            raise RuntimeError("the step was not prepared in the CUDA graphs' input buffers")
        else:
            last = hidden[self.bufs.logits_indices[: self.graphs.logit_rows(n)]]
        return self.model.compute_logits(last, upcast=False)[:n]

    @on_device
    def collect(self, pending: PendingOutput) -> ModelRunnerOutput:
        """Wait for a queued step's outputs: the step's one host sync."""
        self.check_open()
        if pending.ready is not None:
            pending.ready.synchronize()
        sampled = pending.sampled.tolist()
        if self.processors or self.states.sampling.history:
            self._record(pending, sampled)
        logprobs = None
        if pending.logprobs is not None:
            logprobs = SampledLogprobs(*(t.numpy() for t in pending.logprobs))
        prompt_logprobs = {rid: PromptLogprobs(start, ids.numpy(), scores.numpy(), ranks.numpy())
                           for rid, (start, ids, scores, ranks) in pending.prompt_logprobs.items()}
        beams = None
        if pending.beams is not None:
            scores, parents, tokens, lp_ints, lp_floats = (None if t is None else t.numpy() for t in pending.beams)
            beams = BeamCandidates(scores, parents.astype(np.int32), tokens.astype(np.int32),
                                   None if lp_ints is None else SampledLogprobs(lp_ints, lp_floats))
        return ModelRunnerOutput(pending.req_ids, sampled, logprobs, prompt_logprobs, beams)

    def _prompt_logprobs(self, batch, hidden: torch.Tensor) -> dict[str, tuple]:
        """Scores of the prompt tokens this step's chunks predict, for requests
        with prompt_logprobs, from the raw logits: each prompt token, then the
        top-k or the request's logprob_token_ids. Request id -> (start,
        token ids, scores, ranks) on the device."""
        st = self.states.sampling
        slots = batch.idx_mapping_np
        rows = np.nonzero(st.prompt_logprobs.np[slots] >= 0)[0]
        result = {}
        for r in rows.tolist():
            slot = int(slots[r])
            n = int(batch.num_scheduled_np[r])
            start = int(batch.seq_lens_np[r]) - n
            end = min(start + n, int(st.num_prompt.np[slot]) - 1)  # the last prompt token predicts an output
            if end <= start:
                continue
            first = int(batch.query_start_loc_np[r])
            logits = self.model.compute_logits(hidden[first : first + end - start])  # [m, vocab]
            targets = self.states.token_ids.gpu[slot, start + 1 : end + 1].long()
            num_ids = int(st.num_lp_ids.np[slot])
            if num_ids:  # the request's logprob_token_ids, as for its generated positions
                chosen = st.lp_ids.gpu[slot, :num_ids].expand(len(targets), num_ids)
            else:
                chosen = logits.topk(int(st.prompt_logprobs.np[slot]), dim=-1).indices
            ids = torch.cat([targets[:, None], chosen], dim=1)
            act = st.act.gpu[slot].expand(len(ids))
            result[batch.req_ids[r]] = (start, ids, dispatch.compute_scores(logits, ids, act),
                                        dispatch.token_ranks(logits, targets))
        return result

    def _advance(self, batch, sampled: torch.Tensor | None) -> None:
        """Move each slot past this step on the device and the host: computed
        counts grow by the scheduled tokens, and rows that computed their
        last known token append the sampled one on the device (the next step
        reads it there); the host counts it before knowing its value. With
        sampled None, a sampling graph has made the device's part."""
        states = self.states
        slots = batch.idx_mapping_np
        states.num_computed.np[slots] = batch.seq_lens_np
        if sampled is not None:
            dispatch.advance_slots(batch.idx_mapping, batch.attn.seq_lens, batch.sample_rows, sampled,
                                   states.num_computed.gpu, states.token_ids.gpu)
        states.num_tokens[slots[batch.sample_rows_np]] += 1

    def _record(self, pending: PendingOutput, sampled: list[int]) -> None:
        """Hand sampled tokens to what keeps host-side histories (bad words,
        custom logits processors), for slots still held by the same request."""
        states = self.states
        for r in pending.sample_rows.tolist():
            slot = int(pending.slots[r])
            if states.req_to_slot.get(pending.req_ids[r]) != slot:
                continue  # left (finished, aborted, preempted) since the step was queued
            token = sampled[r]
            states.sampling.append(slot, token)
            for proc in self.processors:
                proc.record(slot, token)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Queue a copy to pinned host memory (torch pins the destination of a
    non-blocking device-to-host copy); valid once the step's event has passed."""
    return t.to("cpu", non_blocking=True)
