#!/usr/bin/env bash
# On a GPU machine (torch, triton and transformers preinstalled): install the
# carried wheels, then run the CUDA test module and a short timing of the
# current engine. Usage: bash benchmarks/gpu_check.sh  (from the repo root)
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/hr && ln -sfn "$PWD" /tmp/hr/headrace
export PYTHONPATH=/tmp/hr:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
python3 benchmarks/streaming.py --device cuda 2>&1 | grep -v -i warn | tee "${OUT:-/tmp}/streaming.log"
