"""Checkpoints the benchmarks share."""
from __future__ import annotations


def qwen3_06b_checkpoint():
    """The Qwen3-0.6B shape with random bf16 weights, built once and cached:
    hidden 1024, 28 layers, 16 query and 8 KV heads of 128, intermediate
    3072, vocabulary 151936, tied embeddings."""
    import torch

    from headrace import envs
    from headrace.testing import make_checkpoint

    return make_checkpoint(envs.cache_dir() / "qwen3-0.6b-random", "qwen3", hidden_size=1024, num_layers=28,
                           num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                           tie_word_embeddings=True, vocab_size=151936, max_position_embeddings=4096,
                           dtype=torch.bfloat16, initializer_range=0.02, rope_theta=1000000.0)


class StepTimeline:
    """CUDA events around each step the executor queues, to measure the time
    the GPU sits idle between steps without adding a host sync: a step's
    start event is reached when the GPU gets to its first operation, its end
    event when the step's last operation (the host copies) is done. While the
    GPU has queued work the next start follows the last end at once; a gap
    means it waited for the host."""

    def __init__(self, core) -> None:
        import torch

        self.events: list = []  # (start, end) per step
        execute = core.executor.execute

        def timed(sched):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pending = execute(sched)
            end.record()
            self.events.append((start, end))
            return pending

        core.executor.execute = timed

    def reset(self) -> None:
        self.events.clear()

    def idle(self) -> tuple[float, float]:
        """(GPU idle between steps, wall from the first start to the last end), in
        seconds; call after torch.cuda.synchronize()."""
        if len(self.events) < 2:
            return 0.0, 0.0
        gaps = sum(max(0.0, end.elapsed_time(nxt)) for (_, end), (nxt, _) in zip(self.events, self.events[1:]))
        wall = self.events[0][0].elapsed_time(self.events[-1][1])
        return gaps / 1e3, wall / 1e3


def gpu_busy(prof) -> tuple[float, float]:
    """(seconds some kernel or copy ran, seconds from the first one's start to
    the last one's end) in what a torch profiler recorded with CUDA activity:
    1 - busy / wall is the share of time the GPU sat idle, between steps or
    within them."""
    import torch

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0
    busy, (lo, hi) = 0.0, spans[0]
    first = lo
    for start, end in spans[1:]:
        if start > hi:
            busy += hi - lo
            lo, hi = start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    return busy / 1e6, (hi - first) / 1e6
