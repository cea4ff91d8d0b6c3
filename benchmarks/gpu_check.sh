#!/usr/bin/env bash
# On a GPU machine (torch, triton and transformers preinstalled): install the
# carried wheels (.whl: msgspec, pyzmq), then run the stages named, in order:
#   tests       the CUDA tests (engine, overlap, Triton kernels)
#   ptests      the two-GPU tests alone (tests/test_gpu_parallel.py)
#   decode      benchmarks/decode_step.py, profiling batch 256 x context 1024
#   throughput  benchmarks/throughput.py
#   logprobs    benchmarks/logprobs_cost.py
#   streaming   benchmarks/streaming.py
#   serving     benchmarks/serving.py $SERVING_ARGS (in-process peer, bursts, scale-out, HTTP, Poisson arrivals in
#               process and through HTTP; --py-spy SECONDS needs py-spy among the wheels); its http parts
#               need among the wheels starlette, uvicorn, httptools, openai, pydantic, pydantic-core,
#               jiter, distro, sniffio, annotated-types, typing-inspection (cp312 for the compiled ones;
#               the machine has httpx, anyio, h11, click and tqdm); openai 3.x also needs httpx2, httpcore2,
#               truststore and newer anyio, h11 and idna, and uvloop and prometheus-client may be missing too
#               (all carried, the HTTP parts ran on an H200 on 2026-11-28)
#   prefill     benchmarks/prefill_step.py, profiling batch 64 with a 512-token prompt
#   gguf        benchmarks/gguf_parity.py (needs gguf and accelerate among the wheels and the SmolLM2
#               file already in $HEADRACE_CACHE_DIR/smollm2: the machine cannot fetch it)
#   parallel    benchmarks/parallel.py --configs $PARALLEL_CONFIGS (default tp1: the Qwen3-8B shape on one
#               GPU; tp2, tp2-nccl and dp2 need two)
#   pserve      benchmarks/serving.py's http part (headrace serve, openai clients) on the Qwen3-8B shape with
#               --tensor-parallel-size 2, then --data-parallel-size 2 (two GPUs; needs the http wheels)
#   tp          benchmarks/tp_step.py (two GPUs): all-reduce by message size, decode steps at one GPU and two
#   frontend    benchmarks/frontend_cost.py on the Qwen3-0.6B checkpoint's tokenizer (CPU only)
#   beam        benchmarks/beam_search.py $BEAM_ARGS (default: the Qwen3-8B shape, 100 prompts, beam width 4)
#   quantized   benchmarks/quantized.py $QUANTIZED_ARGS (bf16, fp8, int4 on the Qwen3-8B shape; its gguf part: as gguf)
#   attention   benchmarks/decode_attention.py (the decode attention kernel by split count)
#   pattention  benchmarks/prefill_attention.py --sweep (the prefill attention kernel by tile, beside torch's flash)
#   sampling    benchmarks/sampling_kernel.py (the Gumbel sampling kernel against the logits' bytes and torch's sampler)
#   dense       benchmarks/dense_kernel.py (few-row projections with their norm and activation, against cuBLAS)
#   sweeps      the few-row projection kernels' launch configs swept on this GPU: benchmarks/int4_kernel.py at
#               one row (Qwen3-8B's four projections), benchmarks/fp8_kernel.py at 1 to 64 rows (each row
#               count's configs ranked by their sum over the four) and benchmarks/dense_kernel.py on the
#               Qwen3-0.6B shape at 1 and 8 rows
#   int4mma     benchmarks/int4_mma.py (4-bit projections of 1-8 rows on mma.sync, against int4_gemv and tl.dot)
#   startup     benchmarks/startup.py $STARTUP_ARGS (LLM, AsyncEngine.from_model and headrace serve: spawn to
#               ready, with the core's phases; needs the http wheels for serve)
#   single      benchmarks/single_stream.py $SINGLE_ARGS (batch-1 decode on the Qwen3-0.6B shape and the SmolLM2
#               GGUF beside transformers' static cache under torch.compile; needs gguf and accelerate among the
#               wheels and the SmolLM2 file already in $HEADRACE_CACHE_DIR/smollm2, as gguf does)
#   ttft        benchmarks/request_ttft.py $TTFT_ARGS (one request at a time: AsyncEngine, then headrace serve
#               through httpx and the openai client; needs the http wheels)
#   pdl         benchmarks/decode_step.py at batch 1 and 8, context 1024, with HEADRACE_FUSED_PROJECTIONS and
#               HEADRACE_PDL off and on, twice each, in turn
#   targets     every step and throughput target of issues 21 and 22 in one call (about 6 minutes on an H200):
#               decode_step.py at batch 1 and 8, contexts 1024 and 4096; throughput.py's overlapped run twice,
#               by rows; quantized.py's batch-1 decode in bf16, fp8 and int4, and its community part
#   targets-serving  issue 22's serving targets (about 7 minutes): serving.py's bursts (logprobs=5 three times)
#               and Poisson arrivals at 8 and 24 req/s in process and through HTTP, each rate three times
#               (--poisson-runs); needs the http wheels. With the startup stage, every target is measured
#   ab          $AB_CMD (a shell command, run from a tree's root) in this tree and in the copy of the project at
#               $AB_TREE (say `git archive REV | tar -x -C DIR`, carried along), in turn, $AB_RUNS times each
#               (default 2): both sides of a comparison on one machine, each named by its source_id
# Usage: bash benchmarks/gpu_check.sh tests decode throughput
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/hr && ln -sfn "$PWD" /tmp/hr/headrace
export PYTHONPATH=/tmp/hr:/tmp/site:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH  # the carried wheels' programs (py-spy)
export HEADRACE_CACHE_DIR=${HEADRACE_CACHE_DIR:-/tmp/headrace-cache}
# Never NVLink multicast (headrace sets these in the processes it starts, too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
python3 -c 'from benchmarks_common import source_id; print("source", source_id())'  # git metadata may be stale here
for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    ptests) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_parallel.py 2>&1 | tee "$out/gpu_parallel_tests.log" | tail -30 ;;
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_parallel.py tests/test_overlap.py tests/test_triton_kernels.py \
             tests/test_attention_kernels.py tests/test_layer_kernels.py tests/test_input_prep.py \
             tests/test_int4_kernels.py tests/test_gguf_kernels.py tests/test_dense_kernel.py tests/test_kernels.py \
             tests/test_graph_sizes.py tests/test_beam_search.py 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    decode) python3 benchmarks/decode_step.py --profile 256x1024 2>&1 | grep -v -i warn | tee "$out/decode_step.log" ;;
    throughput) python3 benchmarks/throughput.py 2>&1 | grep -v -i warn | tee "$out/throughput.log" ;;
    logprobs) python3 benchmarks/logprobs_cost.py --qwen3-0.6b --device cuda --batch 64 2>&1 | grep -v -i warn \
                | tee "$out/logprobs_cost.log" ;;
    streaming) python3 benchmarks/streaming.py --device cuda --max-tokens 256 --repeats 5 2>&1 | grep -v -i warn | tee "$out/streaming.log" ;;
    serving) python3 benchmarks/serving.py --device cuda --repeats 5 --json "$out/serving.json" ${SERVING_ARGS:-} 2>&1 | grep -v -i warn \
               | tee "$out/serving.log" ;;
    prefill) python3 benchmarks/prefill_step.py --profile 64x512 2>&1 | grep -v -i warn | tee "$out/prefill_step.log" ;;
    gguf) python3 benchmarks/gguf_parity.py --device cuda 2>&1 | grep -v -i warn | tee "$out/gguf_parity.log" ;;
    parallel) python3 benchmarks/parallel.py --configs "${PARALLEL_CONFIGS:-tp1}" 2>&1 | grep -v -i warn | tee "$out/parallel.log" ;;
    pserve) m=$(python3 -c 'from benchmarks_common import qwen3_8b_checkpoint as c; print(c())' | tail -1)
            for flags in "--tensor-parallel-size 2" "--data-parallel-size 2"; do
              echo "--- headrace serve $flags"
              python3 benchmarks/serving.py --parts http --device cuda --model "$m" $flags 2>&1 | grep -v -i warn \
                | tee -a "$out/serve_parallel.log"
            done ;;
    tp) python3 benchmarks/tp_step.py ${TP_STEP_ARGS:-} 2>&1 | tee "$out/tp_step.log" ;;
    frontend) python3 -c 'from benchmarks_common import qwen3_06b_checkpoint as c; print(c())' | tail -1 \
                | xargs -I{} python3 benchmarks/frontend_cost.py --model {} 2>&1 | tee "$out/frontend_cost.log" ;;
    beam) python3 benchmarks/beam_search.py ${BEAM_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/beam_search.log" ;;
    quantized) python3 benchmarks/quantized.py ${QUANTIZED_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/quantized.log" ;;
    attention) python3 benchmarks/decode_attention.py 2>&1 | tee "$out/decode_attention.log" ;;
    pattention) python3 benchmarks/prefill_attention.py --sweep 2>&1 | grep -v -i warn | tee "$out/prefill_attention.log" ;;
    sampling) python3 benchmarks/sampling_kernel.py 2>&1 | grep -v -i warn | tee "$out/sampling_kernel.log" ;;
    dense) python3 benchmarks/dense_kernel.py ${DENSE_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/dense_kernel.log" ;;
    sweeps) { python3 benchmarks/int4_kernel.py --ms 1 --sweep
              python3 benchmarks/fp8_kernel.py --sweep
              python3 benchmarks/dense_kernel.py --model 0.6b --ms 1,8 --sweep
            } 2>&1 | grep -v -i warn | tee "$out/sweeps.log" ;;
    int4mma) python3 benchmarks/int4_mma.py 2>&1 | grep -v -i warn | tee "$out/int4_mma.log" ;;
    single) python3 benchmarks/single_stream.py ${SINGLE_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/single_stream.log" ;;
    startup) python3 benchmarks/startup.py ${STARTUP_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/startup.log" ;;
    ttft) python3 benchmarks/request_ttft.py ${TTFT_ARGS:-} 2>&1 | grep -v -i warn | tee "$out/request_ttft.log" ;;
    targets) { python3 benchmarks/decode_step.py --batches 1,8 --contexts 1024,4096 --steps 64
               python3 benchmarks/throughput.py --parts overlapped --repeats 2 --by-rows
               python3 benchmarks/quantized.py --parts decode,community --formats bf16,fp8,int4 --batches 1
             } 2>&1 | grep -v -i warn | tee "$out/targets.log" ;;
    targets-serving) python3 benchmarks/serving.py --device cuda --parts inproc,burst,burst-logprobs,http,poisson,http-poisson \
                       --repeats 3 --poisson-runs 3 --rates 8,24 2>&1 | grep -v -i warn | tee "$out/targets_serving.log" ;;
    pdl) for run in 1 2; do
           for v in "0 0" "1 0" "0 1" "1 1"; do set -- $v
             echo "--- fused $1, pdl $2" | tee -a "$out/decode_switches.log"
             HEADRACE_FUSED_PROJECTIONS=$1 HEADRACE_PDL=$2 python3 benchmarks/decode_step.py --batches 1,8 \
               --contexts 1024 --steps 32 2>&1 | grep -E "^ +[0-9]+ +[0-9]+ " | tee -a "$out/decode_switches.log"
           done
         done ;;
    ab) if [ -z "${AB_TREE:-}" ] || [ -z "${AB_CMD:-}" ]; then echo "stage ab needs AB_TREE and AB_CMD"; exit 2; fi
        other=$(cd "$AB_TREE" && pwd) || exit 2
        mkdir -p /tmp/hr_ab && ln -sfn "$other" /tmp/hr_ab/headrace
        for run in $(seq "${AB_RUNS:-2}"); do
          for side in "$PWD /tmp/hr" "$other /tmp/hr_ab"; do set -- $side
            (cd "$1" && export PYTHONPATH=$2:/tmp/site:$1/benchmarks &&
              echo "--- $1 (source $(python3 -c 'from benchmarks_common import source_id; print(source_id())')), run $run" &&
              bash -c "$AB_CMD") 2>&1 | grep -v -i warn | tee -a "$out/ab.log"
          done
        done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
