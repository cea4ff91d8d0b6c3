"""What the benchmarks share: the checkpoint, the workload, the ceilings, the
floor, the step timeline, and the processes of the serving benchmarks."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time


def source_id(root: str | None = None) -> str:
    """A short hash of the Python source under the project root (every .py
    file outside hidden folders and .venv, by path and content): it names the
    code a run measured where a copied tree's git metadata may be stale. The
    same on a checkout of a commit gives that commit's id."""
    import hashlib
    from pathlib import Path

    base = Path(root) if root else Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part.startswith(".") or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:10]


def qwen3_06b_checkpoint():
    """The Qwen3-0.6B shape with random bf16 weights, built once and cached:
    hidden 1024, 28 layers, 16 query and 8 KV heads of 128, intermediate
    3072, vocabulary 151936, tied embeddings. Its tokenizer covers the whole
    vocabulary (synthetic words and CJK byte pieces beyond the trained ones),
    so every sampled id detokenizes to text, as with a real checkpoint."""
    import torch

    from headrace import envs
    from headrace.testing import make_checkpoint

    return make_checkpoint(envs.cache_dir() / "qwen3-0.6b-random-full-tokenizer", "qwen3", hidden_size=1024,
                           num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                           tie_word_embeddings=True, vocab_size=151936, max_position_embeddings=4096,
                           dtype=torch.bfloat16, initializer_range=0.02, rope_theta=1000000.0,
                           full_vocab_tokenizer=True)


def qwen3_8b_checkpoint():
    """The Qwen3-8B shape with random bf16 weights (normal, std 0.02; norms
    1), built once and cached: hidden 4096, 36 layers, 32 query and 8 KV heads
    of 128, intermediate 12288, vocabulary 151936, untied embeddings. The
    weights are drawn tensor by tensor in bf16 and written straight to
    safetensors shards (a transformers init of 8B float32 parameters takes
    minutes); the tokenizer covers the vocabulary as qwen3_06b_checkpoint's."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    from headrace import envs
    from headrace.testing.tokenizer import build_tokenizer

    path = envs.cache_dir() / "qwen3-8b-random"
    if (path / "model.safetensors.index.json").exists():
        return path
    work = path.with_name(path.name + ".part")
    work.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(work, fill_to=151936)
    config = Qwen3Config(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
                         max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         dtype="bfloat16")
    config.save_pretrained(work)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, index = {}, {}, 0, 0
    names = list(shapes)
    for i, name in enumerate(names):
        shape = shapes[name]
        t = torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else \
            (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name], size = t, size + t.numel() * 2
        if size >= 4 * 2**30 or i == len(names) - 1:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(work / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in shard})
            shard, size, index = {}, 0, index + 1
    (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    work.rename(path)
    return path


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The small-engine community's workload: (prompts, max_tokens) of n requests,
    prompts of uniform [100, 1024] random token ids in [0, 10000), max_tokens
    uniform [100, 1024]. Run with temperature 0.6, ignore_eos, max_model_len 4096."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    max_tokens = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, max_tokens


@dataclasses.dataclass
class StepShape:
    """What one step computed: batch rows, tokens, cached tokens read, rows that sampled, (query, key) pairs."""

    rows: int
    tokens: int
    kv_tokens: int
    sampled_rows: int
    pairs: int


# Row-count brackets of decode steps (one token a row) for by_rows, by name; steps with a prefill chunk are "mixed".
ROW_BRACKETS = {"1-8": 8, "9-32": 32, "33-128": 128, "129+": 1 << 30}


def by_rows(shapes: list[StepShape], spans: list[tuple[float, float]], step_floor) -> list[str]:
    """A run's steps in brackets of batch rows (decode steps) or as mixed steps (a prefill chunk among the
    rows): steps, GPU seconds, seconds the GPU waited for the host before them, the floor (step_floor's
    bytes and FLOPs terms), and (GPU + wait) / floor. spans holds (GPU seconds, wait before) a step, in
    the order of shapes (StepTimeline.spans). A step's GPU seconds run from its start event, recorded as
    the host begins to queue it, to its end: a wait for the host's queuing inside the step counts there,
    not as wait."""
    if len(shapes) != len(spans):
        raise ValueError(f"{len(shapes)} recorded steps but {len(spans)} timed ones")
    groups: dict[str, list[int]] = {name: [] for name in [*ROW_BRACKETS, "mixed"]}
    for i, shape in enumerate(shapes):
        mixed = shape.tokens > shape.rows
        groups["mixed" if mixed else next(n for n, hi in ROW_BRACKETS.items() if shape.rows <= hi)].append(i)
    lines = [f"{'rows':>8} {'steps':>6} {'GPU s':>7} {'wait s':>7} {'floor s':>7} {'x floor':>7}"]
    for name, idx in groups.items():
        if not idx:
            continue
        gpu, wait = sum(spans[i][0] for i in idx), sum(spans[i][1] for i in idx)
        floor = sum(sum(step_floor.seconds(1, shapes[i].kv_tokens, shapes[i].tokens, shapes[i].sampled_rows,
                                           shapes[i].pairs)) for i in idx)
        lines.append(f"{name:>8} {len(idx):>6} {gpu:7.3f} {wait:7.3f} {floor:7.3f} {(gpu + wait) / floor:7.2f}")
    return lines


class ScheduleRecorder:
    """Over the executed steps: tokens computed, KV tokens read, rows that
    sampled, and (query, key) pairs attended (causal within a chunk); each
    step's in per_step, the run's as the totals below."""

    def __init__(self, core) -> None:
        self.per_step: list[StepShape] = []
        execute = core.executor.execute

        def recording(sched):
            # tokens in the cache before the step (the scheduler has counted the step's already)
            computed = {r.request_id: r.num_computed_tokens - sched.num_scheduled_tokens[r.request_id]
                        for r in sched.reqs}
            kv_tokens = pairs = 0
            for rid, n in sched.num_scheduled_tokens.items():
                kv_tokens += computed[rid] + n
                pairs += n * computed[rid] + n * (n + 1) // 2
            self.per_step.append(StepShape(len(sched.num_scheduled_tokens), sched.total_num_scheduled_tokens,
                                           kv_tokens, sum(sched.samples), pairs))
            return execute(sched)

        core.executor.execute = recording
        self.detach = lambda: setattr(core.executor, "execute", execute)

    def _total(self, field: str) -> int:
        return sum(getattr(s, field) for s in self.per_step)

    steps = property(lambda self: len(self.per_step))
    tokens = property(lambda self: self._total("tokens"))
    kv_tokens = property(lambda self: self._total("kv_tokens"))
    sampled_rows = property(lambda self: self._total("sampled_rows"))
    pairs = property(lambda self: self._total("pairs"))


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

    def spans(self) -> list[tuple[float, float]]:
        """(GPU seconds, seconds idle before it) a step; call after torch.cuda.synchronize()."""
        out = []
        for i, (start, end) in enumerate(self.events):
            wait = max(0.0, self.events[i - 1][1].elapsed_time(start)) if i else 0.0
            out.append((start.elapsed_time(end) / 1e3, wait / 1e3))
        return out

    def idle(self) -> tuple[float, float]:
        """(GPU idle between steps, wall from the first start to the last end), in
        seconds; call after torch.cuda.synchronize()."""
        if len(self.events) < 2:
            return 0.0, 0.0
        wall = self.events[0][0].elapsed_time(self.events[-1][1])
        return sum(wait for _, wait in self.spans()), wall / 1e3


class GcPauses:
    """The garbage collector's pauses in this process while attached (gc.callbacks), to tell a wait for
    the host that a collection made from one that the engine's own work made."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds) per collection
        self._start = 0.0

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._record)

    def summary(self) -> str:
        full = [s for gen, s in self.pauses if gen == 2]
        return (f"host GC {sum(s for _, s in self.pauses):.3f} s in {len(self.pauses)} collections, "
                f"{len(full)} full (longest {1e3 * max(full, default=0.0):.1f} ms)")


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


def heads_and_configs(parser, heads: str, configs: str, form: str) -> tuple[int, int, list[tuple[int, ...]]]:
    """(query heads, KV heads, launch configs) from a kernel benchmark's --heads Q,KV and --configs
    A,B,...;... (form names one entry's fields, comma-separated: each needs that many positive numbers).
    A malformed value ends the run through parser.error, naming the forms."""
    width = len(form.split(","))
    try:
        q_heads, kv_heads = map(int, heads.split(","))
        launches = [tuple(map(int, c.split(","))) for c in configs.split(";") if c]
    except ValueError:
        parser.error(f"--heads takes Q,KV and --configs {form}[;...], got {heads!r} and {configs!r}")
    if q_heads < 1 or kv_heads < 1 or q_heads % kv_heads or any(len(c) != width or min(c) < 1 for c in launches):
        parser.error(f"--heads needs positive query heads, a multiple of the KV heads; each --configs entry is "
                     f"{form}, all positive")
    return q_heads, kv_heads, launches


def measure_ceilings(device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s).

    Each is timed on the device (CUDA events around 10 back-to-back calls, the
    median of 5 such groups), so neither the launch nor the host's wait for the
    device counts: a 256 MiB copy takes about 0.19 ms, where a host round trip
    would add several percent and make the floors move from process to process."""
    import torch

    src = torch.randn(2**28 // 2, device=device, dtype=torch.bfloat16)  # 256 MiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, n=10, groups=5):  # seconds a call
        for _ in range(3):
            fn()
        times = []
        for _ in range(groups):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n)
        return statistics.median(times)

    bw = 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src))
    rate = 2 * 8192**3 / timed(lambda: a @ b)
    return bw, rate


class StepFloor:
    """The floor of a step from what it computes: every weight read once, and
    each row's cached KV, at the copy bandwidth; plus matmul FLOPs at the
    matmul rate: two per weight per computed token for the layers, two per
    LM-head weight only for rows that sample, and 4 * heads * head_dim per
    layer for each (query, key) pair of attention."""

    def __init__(self, core, bw: float, rate: float) -> None:
        import torch

        from headrace.executor.models.loader import MODELS

        cfg = core.model_config
        with torch.device("meta"):  # the whole model's shapes, whatever ranks hold them
            num_params = sum(p.numel() for p in MODELS[cfg.model_type](cfg, 1).parameters())
        self.weight_bytes = num_params * core.executor.dtype.itemsize
        self.head_params = cfg.vocab_size * cfg.hidden_size
        # the embedding table is a lookup, not a matmul (tied: it is also the LM head)
        self.layer_params = num_params - self.head_params * (1 if cfg.tie_word_embeddings else 2)
        self.kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * core.executor.dtype.itemsize
        self.attn_flops_per_pair = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers
        self.bw, self.rate = bw, rate

    def seconds(self, steps: int, kv_tokens: int, tokens: int, sampled_rows: int, pairs: int) -> tuple[float, float]:
        """(bytes term, FLOPs term) for `steps` steps reading kv_tokens cached tokens in all,
        computing `tokens` tokens, sampling `sampled_rows` rows and attending over `pairs` pairs."""
        t_bytes = (steps * self.weight_bytes + kv_tokens * self.kv_per_token) / self.bw
        flops = 2 * self.layer_params * tokens + 2 * self.head_params * sampled_rows + self.attn_flops_per_pair * pairs
        return t_bytes, flops / self.rate


@contextlib.contextmanager
def core_process(model: str, device: str, *flags: str):
    """A `headrace core` process serving model on a private ipc socket, started
    as a user starts one (flags: more of its options); yields its address once
    it serves, and stops it on leaving."""
    from headrace.frontend.core_process import private_ipc_address, remove_private_ipc

    address, directory = private_ipc_address()
    proc = subprocess.Popen([sys.executable, "-m", "headrace.frontend.cli", "core", "--model", model,
                             "--address", address, "--device", device, *flags], stdout=subprocess.PIPE, text=True)
    try:
        if "serving" not in proc.stdout.readline():
            raise RuntimeError(f"the core did not start (exit status {proc.wait()})")
        yield address
    finally:
        proc.terminate()
        proc.wait()
        remove_private_ipc(address, directory)


def run_workers(cmd: list[str], jobs: list, on_go=None) -> tuple[float, list]:
    """One process running cmd per job. Each reads its job as a JSON line on
    stdin, gets ready, prints "ready" and waits for a line "go", which all get
    at once when all are ready (on_go() is called just before); then it prints
    its answer as a JSON line. Returns (seconds from "go" to the last answer,
    the answers)."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in jobs]
    try:
        for proc, job in zip(procs, jobs):
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker process failed to get ready (exit status {proc.poll()})")
        if on_go is not None:
            on_go()
        t0 = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = [json.loads(proc.stdout.readline()) for proc in procs]
        return time.perf_counter() - t0, answers
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.wait()


def worker_answer(result) -> None:
    """A run_workers process's answer: one JSON line on stdout, written whole.
    With latency lists the line is far longer than a pipe holds (64 KiB), and
    one answer came back cut at 64 KiB through print(), so the bytes go out
    with os.write, on a blocking descriptor, until all are written."""
    sys.stdout.flush()
    fd = sys.stdout.fileno()
    os.set_blocking(fd, True)
    data = (json.dumps(result) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def host_profile(seconds: float, label: str, deferred: bool = False, rate: int = 100):
    """Sample this process and every process it starts (cores, API servers, clients) with py-spy for
    `seconds` (0: not at all) from the block's start, or, if deferred, from when the block calls the
    function this yields; then print, per kind of process, how busy its Python threads were and the
    functions where the samples fell. Needs py-spy on PATH (a wheel can be carried); without it, says
    so and runs the block unprofiled. Busy samples only: time in a call that waits (poll, a lock, a
    GPU synchronize) does not count."""
    import shutil
    import tempfile

    exe = shutil.which("py-spy") if seconds > 0 else None
    if seconds > 0 and exe is None:
        print(f"{label}: py-spy not found on PATH; not profiled", flush=True)
    run: dict = {}  # the py-spy process, its output file and when it started

    def start() -> None:
        if exe is not None and not run:
            fd, path = tempfile.mkstemp(suffix=".txt", prefix="py-spy-")
            os.close(fd)
            run["path"] = path
            run["proc"] = subprocess.Popen(
                [exe, "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking", "--duration",
                 str(max(1, round(seconds))), "--rate", str(rate), "--format", "raw", "-o", path],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            run["t0"] = time.perf_counter()

    if not deferred:
        start()
    try:
        yield start
    finally:
        if run:
            covered = min(time.perf_counter() - run["t0"], seconds)
            proc, path = run["proc"], run["path"]
            try:
                _, err = proc.communicate(timeout=max(0.0, seconds - covered) + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0 or not os.path.getsize(path):
                print(f"{label}: py-spy failed: {err.strip()[-500:]}", flush=True)
            else:
                print(f"--- host profile of {label} (py-spy, {covered:.1f} s)", flush=True)
                print("\n".join(profile_summary(path, covered * rate)), flush=True)
            os.unlink(path)


_PROCESS_KINDS = (("headrace.frontend.api.server", "API server"), ("cli core", "engine core"),
                  ("cli serve", "headrace serve"), ("--http-client", "http client"), ("--frontend", "frontend"))


def profile_summary(path: str, samples_per_process: float, top: int = 6) -> list[str]:
    """py-spy's raw (collapsed) stacks at path -> lines per kind of process: its processes, their mean
    busy share (samples / samples_per_process), the `top` functions where samples ended (self) and the
    `top` ones they passed through (within; frames in 90% of the kind's samples or more, such as the
    event loop's, left out). Line numbers are dropped."""
    import re
    from collections import Counter, defaultdict

    within: dict[str, Counter] = defaultdict(Counter)  # kind -> function -> samples
    leaf: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    pids: dict[str, set] = defaultdict(set)
    text = open(path).read()
    for stack, count in re.findall(r"(.*?) (\d+)\n", text, flags=re.S):  # a command line may hold newlines
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        command = procs[-1] if procs else ""
        kind = next((name for key, name in _PROCESS_KINDS if key in command), "benchmark")
        fns = [re.sub(r":\d+\)$", ")", f) for f in frames if not f.startswith("process ")]
        if not fns:
            continue
        n = int(count)
        pids[kind].add(command.split(":", 1)[0])
        totals[kind] += n
        leaf[kind][fns[-1]] += n
        for fn in set(fns):
            within[kind][fn] += n
    lines = []
    for kind, total in totals.most_common():
        busy = total / max(1.0, samples_per_process) / len(pids[kind])
        lines.append(f"{kind}: {len(pids[kind])} process(es), busy {100 * busy:.0f}% each on average, {total} samples")
        for name, counter, cut in (("self", leaf[kind], 1.01), ("within", within[kind], 0.9)):
            for fn, n in [(f, n) for f, n in counter.most_common() if n < cut * total][:top]:
                lines.append(f"  {name:6} {100 * n / total:5.1f}%  {fn[:130]}")
    return lines


def graph_call_us(calls: list, replays: int = 10) -> float:
    """Median microseconds of one call, from CUDA-graph replays of all the calls in turn
    (kernel benchmarks: each call reads its own weights, so that none stays in L2)."""
    import torch

    for call in calls:  # compiles outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)
