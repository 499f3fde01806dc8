#!/usr/bin/env bash
# The GPU check in one command: the GPU test tier, then the sampler / update / reshard
# benchmarks on a Qwen2.5-0.5B-shaped model (random weights, bf16), then one JSON summary
# and a markdown table for docs/benchmarks.md. Logs go to $GPU_CHECK_OUT (outputs/gpu_check).
#
#   bash launch/gpu_check.sh            # exit status: 0 when the GPU tests pass
#   bash launch/gpu_check.sh --quick    # ~5 minutes (a short GPU lease): the tests with the quickstart
#                                       # beside them, the CUDA allocator's per-phase peaks, tiny/100M samplers
#   bash launch/gpu_check.sh --step     # ~7 minutes: torch's attention kernels against their references
#                                       # (tests/gpu/test_torch_attention_gpu.py), then bench/gpu_step.py
#                                       # (decode roofline, prefill / update MFU, HF generate; 1.5B and 7B)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; install the project first (pip install -e .)" >&2; exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); nothing to check" >&2; exit 2
fi
OUT=${GPU_CHECK_OUT:-outputs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--quick" ]; then exec bash launch/gpu_check_quick.sh "$OUT"; fi
if [ "${1:-}" = "--step" ]; then
  timeout 90 "$PY" -m pytest -m gpu tests/gpu/test_torch_attention_gpu.py -q -rs -p no:cacheprovider \
    2>&1 | tee "$OUT/torch_attention.log"
  rc=${PIPESTATUS[0]}
  timeout 420 "$PY" bench/gpu_step.py --device cuda 2>&1 | tee "$OUT/gpu_step.log"
  step_rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$step_rc
  exit "$rc"
fi

"$PY" -m pytest -m gpu tests/gpu -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" bench/sampler.py --device cuda --model qwen2.5-0.5b --batches 1,64,256 --cases equal,uneven \
  2>&1 | tee "$OUT/sampler.log"
"$PY" bench/sampler.py --device cuda --model qwen2.5-0.5b --batches 1,64,256 --cases equal --compile \
  2>&1 | tee "$OUT/sampler_graph.log"
"$PY" bench/train_step.py --device cuda --preset qwen2.5-0.5b --dtype bfloat16 --batch 64 --micro-batch 8 \
  --max-response 1024 --prompt 128 2>&1 | tee "$OUT/train_step.log"
"$PY" -m torch.distributed.run --standalone --nproc_per_node=1 bench/reshard.py --device cuda \
  --models qwen2.5_0.5b --prompts 64 --n 4 --response-length 256 2>&1 | tee "$OUT/reshard.log"
"$PY" bench/simulate_vs_real.py --device cuda 2>&1 | tee "$OUT/memory.log"  # the simulation vs the allocator
timeout 420 "$PY" bench/gpu_step.py --device cuda 2>&1 | tee "$OUT/gpu_step.log"  # real shapes vs the roofs
"$PY" bench/gpu_summary.py "$OUT" --tests-rc "$tests_rc" | tee "$OUT/summary.md"
exit "$tests_rc"
