#!/usr/bin/env bash
# The GPU checks of the offloading runtime, as one prepared run for a session lent a CUDA machine
# (workplace `device` tool; its image has python3 with CUDA torch, transformers, triton, pytest).
# Nothing is installed: the repository runs from src/. Results land in $OUT (default: results/device).
# The seqmoe system needs a forecaster checkpoint of seqmoe-tiny at results/carry/predictor (copy the
# demo's from ~/.cache/seqmoe/predictors/demo-*; carry results/carry).
#   device run: bash benchmarks/device_check.sh        (about 4 minutes; give it timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
PRED=results/carry/predictor
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "== GPU tests (the slot fence of issue 11: long prompts, large experts, a second request, in test_fence.py)"
  timeout 240 python3 -m pytest -q -m gpu tests/runtime -p no:cacheprovider -rs -W ignore::FutureWarning
  echo "== Triton kernels against the torch ops, interpreted on the CPU"
  timeout 120 python3 -m pytest -q tests/runtime/test_thread.py -k interpreter -p no:cacheprovider -rs
  echo "== decode speed and exactness, seqmoe-tiny, three engines"
  timeout 150 python3 benchmarks/cuda_decode.py --predictor $PRED --out "$OUT/cuda_decode.jsonl" 2>&1 | grep -v Warning
  echo "== seqmoe generate --graph on cuda"
  timeout 40 python3 -m seqmoe.cli generate --model seqmoe-tiny --device cuda --residency 0.25 --system on-demand-lru \
      --prompt "def parse_args(argv):" --max-new-tokens 64 --graph --json 2>&1 | tail -4
  if [ "${CPU_SUITE:-1}" = 1 ]; then
    echo "== CPU suite of the runtime on this machine's transformers"
    timeout 100 python3 -m pytest -q tests/runtime -p no:cacheprovider -m "not gpu" -x -W ignore::FutureWarning 2>&1 | tail -5
  fi
} 2>&1 | tee "$OUT/device_check.log"
