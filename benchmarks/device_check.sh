#!/usr/bin/env bash
# The GPU checks of the offloading runtime, as one prepared run for a session lent a CUDA machine
# (workplace `device` tool; its image has python3 with CUDA torch, transformers, pytest, hypothesis).
# Nothing is installed: the repository runs from src/. Results land in $OUT (default: results/device).
#   device run: bash benchmarks/device_check.sh        (about 2 minutes; give it timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  # GPU tests (skipped on CPU machines), then the CPU suites of the runtime and the collector there too.
  python3 -m pytest -q -m gpu tests/runtime -p no:cacheprovider
  python3 -m pytest -q tests/runtime tests/collect -p no:cacheprovider -x
  # The packaged model offloaded to the GPU: text, tokens/s, hit rate, memory.
  for r in 0.25 1.0; do
    python3 -m seqmoe.cli generate --model seqmoe-tiny --device cuda --residency $r --system on-demand-lru \
        --prompt "def parse_args(argv):" --max-new-tokens 64 --json
  done
} 2>&1 | tee "$OUT/device_check.log"
