#!/usr/bin/env bash
# The GPU checks of the offloading runtime, as one prepared run for a session lent a CUDA machine
# (workplace `device` tool; its image has python3 with CUDA torch, transformers, triton, pytest).
# Nothing is installed: the repository runs from src/. Results land in $OUT (default: results/device).
# The seqmoe system needs a forecaster checkpoint of seqmoe-tiny at results/carry/predictor (copy the
# demo's from ~/.cache/seqmoe/predictors/demo-*; carry results/carry).
#   device run: bash benchmarks/device_check.sh        (about 4 minutes; give it timeout_s=540)
# The real-size part (issue 14; REALSIZE=1 CHECKS=0 to run it alone, in one run of at most 8 minutes)
# needs, carried in results/carry: ds-test.safetensors, ds-train.safetensors (a part of the training
# split: the carry limit is 64 MiB) and ds-predictor/, made here by
#   python -c "from seqmoe.trace.io import load_trace, save_trace; save_trace(load_trace('results/ds/train.safetensors').head(40000), 'results/carry/ds-train.safetensors')"
#   cp results/ds/test.safetensors results/carry/ds-test.safetensors; cp -r results/ds/predictor results/carry/ds-predictor
# and the Mixtral routing (results/carry/mixtral/*_routing.jsonl from ../shared). Not yet run on a GPU.
# The miss paths of issue 15 (MISSPATHS=1 CHECKS=0 CPU_SUITE=0, the same carry, about 8 minutes): the host
# path's exactness on CUDA (inline, and in posted steps, eager and captured), and the real-size DeepSeek harness
# with its captured decode step (control thread) with every miss copied, chosen per miss, and cpu-all.
# Quantized experts of issue 25 (QUANT=1 CHECKS=0 CPU_SUITE=0, about 2 minutes, no carry): their tests on
# CUDA (captured steps, int8/int4 through the dequantizing gather, against the quantized full model) and
# generate with a byte budget per precision.
# Experts streamed from disk of issue 29 (DISK=1 CHECKS=0 CPU_SUITE=0, under a minute, no carry): generate on CUDA
# with a host cache of 40 of seqmoe-tiny's 256 experts.
# Every configuration composing, issue 40 (COMPOSE=1 CHECKS=0 CPU_SUITE=0, about 3 minutes, no carry): the captured
# step with a disk tier, int4 experts and 4 rows against the quantized full model; the server's static cache captured
# per row count; generate with a disk tier and int4, captured (the default) against --eager.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
PRED=results/carry/predictor
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'triton', triton.__version__)"
  if [ "${CHECKS:-1}" = 1 ]; then
  echo "== GPU tests (the slot fence of issue 11: long prompts, large experts, a second request, in test_fence.py)"
  timeout 240 python3 -m pytest -q -m gpu tests/runtime -p no:cacheprovider -rfs --tb=long -W ignore::FutureWarning
  echo "== Triton kernels against the torch ops, interpreted on the CPU"
  timeout 90 python3 -m pytest -q tests/runtime/test_thread.py -k interpreter -p no:cacheprovider -rs
  echo "== decode speed and exactness, seqmoe-tiny, three engines"
  timeout 150 python3 benchmarks/cuda_decode.py --predictor $PRED --out "$OUT/cuda_decode.jsonl" 2>&1 | grep -v Warning
  echo "== seqmoe generate --graph on cuda"
  timeout 40 python3 -m seqmoe generate --model seqmoe-tiny --device cuda --residency 0.25 --system on-demand-lru \
      --prompt "def parse_args(argv):" --max-new-tokens 64 --graph --json 2>&1 | tail -4
  fi
  if [ "${REALSIZE:-0}" = 1 ]; then
    C=results/carry
    echo "== real size: DeepSeek-V2-Lite shapes (27 layers, bf16, random weights), routing of unseen prompts"
    timeout 300 python3 benchmarks/realsize.py --arch deepseek-v2-lite --device cuda --trace $C/ds-test.safetensors \
        --train $C/ds-train.safetensors --predictor $C/ds-predictor --tokens 400 --out "$OUT/realsize_ds.jsonl" 2>&1 | grep -v Warning
    echo "== real size: Mixtral-8x7B shapes, its first 16 of 32 layers (host memory for the pinned experts)"
    timeout 150 python3 benchmarks/realsize.py --arch mixtral-8x7b --device cuda --layers 16 --trace $C/mixtral \
        --systems on-demand-lru,moe-infinity-style,belady,oracle-prefetch --tokens 300 --out "$OUT/realsize_mixtral.jsonl" 2>&1 | grep -v Warning
  fi
  if [ "${MISSPATHS:-0}" = 1 ]; then
    C=results/carry
    echo "== issue 15: the host CPU path on CUDA, exactness (inline; posted steps, eager and captured)"
    timeout 150 python3 -m pytest -q tests/runtime/test_host_path.py tests/runtime/test_host_relay.py -k cuda \
        -p no:cacheprovider -rs -W ignore::FutureWarning
    echo "== issue 15: real-size DeepSeek-V2-Lite, captured step: misses copied / chosen per miss / all on the host CPU"
    for MISS in copy auto; do
      timeout 150 python3 benchmarks/realsize.py --arch deepseek-v2-lite --device cuda --trace $C/ds-test.safetensors \
          --train $C/ds-train.safetensors --predictor $C/ds-predictor --systems on-demand-lru,seqmoe,static-split-style \
          --residencies 0.25,0.45 \
          --tokens 200 --control thread --miss $MISS --out "$OUT/realsize_ds_$MISS.jsonl" 2>&1 | grep -v Warning
    done
    timeout 120 python3 benchmarks/realsize.py --arch deepseek-v2-lite --device cuda --trace $C/ds-test.safetensors \
        --train $C/ds-train.safetensors --systems cpu-all --residencies 0.25 --tokens 200 --control thread \
        --out "$OUT/realsize_ds_cpu_all.jsonl" 2>&1 | grep -v Warning
  fi
  if [ "${QUANT:-0}" = 1 ]; then
    echo "== issue 25: quantized experts on CUDA: captured steps equal the quantized full model; a byte budget"
    timeout 120 python3 -m pytest -q tests/runtime/test_quantized.py -p no:cacheprovider -rs -W ignore::FutureWarning
    for P in int8 int4; do
      timeout 40 python3 -m seqmoe generate --model seqmoe-tiny --device cuda --expert-dtype $P --expert-memory 2MiB \
          --prompt "def parse_args(argv):" --max-new-tokens 64 --graph --json 2>&1 | tail -4
    done
  fi
  if [ "${DISK:-0}" = 1 ]; then
    echo "== issue 29: generate on CUDA with experts streamed from the checkpoint through a host cache"
    for S in on-demand-lru seqmoe; do
      timeout 60 python3 -m seqmoe generate --model seqmoe-tiny --device cuda --residency 0.25 --host-memory 6MiB \
          --system $S --prompt "def parse_args(argv):" --max-new-tokens 64 2>&1 | tail -6
    done
  fi
  if [ "${COMPOSE:-0}" = 1 ]; then
    echo "== issue 40: the captured path with a disk tier, int4 and a batch of 4; the server's captured static cache"
    timeout 200 python3 -m pytest -q -m gpu tests/runtime/disk tests/serve/test_static.py tests/runtime/test_twins.py \
        -p no:cacheprovider -rfs --tb=long -W ignore::FutureWarning
    for D in graph eager; do  # generate captures by default on CUDA; --eager opts out
      timeout 60 python3 -m seqmoe generate --model seqmoe-tiny --device cuda --residency 0.25 --host-memory 6MiB \
          --expert-dtype int4 --prompt "def parse_args(argv):" --max-new-tokens 64 $([ $D = eager ] && echo --eager) \
          2>&1 | grep "tokens in"
    done
  fi
  if [ "${CPU_SUITE:-1}" = 1 ]; then
    echo "== CPU suite of the runtime on this machine's transformers"
    timeout 100 python3 -m pytest -q tests/runtime -p no:cacheprovider -m "not gpu" -x -W ignore::FutureWarning 2>&1 | tail -5
  fi
} 2>&1 | tee "$OUT/device_check.log"
