#!/usr/bin/env bash
# The GPU checks in one short run (about 4-5 minutes on one H200), for a short GPU lease:
#   bash launch/gpu_check.sh --quick     (or: bash launch/gpu_check_quick.sh [OUTDIR])
# 1. the GPU test tier (tests/gpu) and, at the same time, the quickstart (SFT + 60 GRPO steps) on one GPU;
# 2. the real side of bench/simulate_vs_real.py on CUDA (the allocator's per-phase peaks);
# 3. bench/sampler.py on CUDA, eager and with CUDA graphs, alone on the GPU (timings).
# Every step has its own time limit and log, so one failure leaves the others' results.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
t0=$SECONDS
stamp() { echo "[gpu_check] $((SECONDS - t0)) s: $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT/env.txt" || exit 1
import torch, transformers, peft, rlhf
from rlhf.models.varlen_attention import flash_attn_available
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(), "flash-attn", flash_attn_available())
import rlhf.train.trainer, rlhf.rollout.sampler  # noqa: F401  (the whole program imports on this torch)
EOF

qs=$(mktemp -d)
(
  set -e
  $PY -m rlhf.data.synthetic --out "$qs/data" --n-sft 8000
  $PY -m rlhf.models.tiny --out "$qs/init"
  $PY train_sft.py --config configs/quickstart_sft.yaml model.path="$qs/init" sft.train_files="$qs/data/sft.jsonl" \
    trainer.device=cuda trainer.output_dir="$qs/sft"
  $PY train_grpo.py --config configs/quickstart.yaml model.path="$qs/sft/hf_export" \
    data.train_files="$qs/data/train.parquet" data.val_files="$qs/data/val.parquet" trainer.device=cuda \
    trainer.output_dir="$qs/grpo"
) > "$OUT/quickstart.log" 2>&1 &
qs_pid=$!
stamp "quickstart started"

timeout 200 $PY -m pytest -q tests/gpu --deselect tests/gpu/test_quickstart_gpu.py::test_quickstart_learns_on_gpu \
  -p no:cacheprovider --durations=20 -rs > "$OUT/gpu_tests.log" 2>&1
stamp "tests/gpu rc=$? $(tail -1 "$OUT/gpu_tests.log")"

timeout 150 $PY bench/simulate_vs_real.py --device cuda --measured-only > "$OUT/memory_cuda.log" 2>&1
stamp "memory rc=$? (compare here: python bench/simulate_vs_real.py --measured memory_cuda.log)"

while [ $((SECONDS - t0)) -lt 320 ] && kill -0 $qs_pid 2>/dev/null; do sleep 2; done
kill $qs_pid 2>/dev/null && echo "[gpu_check] quickstart cut at its limit" >> "$OUT/quickstart.log"
wait $qs_pid; stamp "quickstart rc=$?"
cp "$qs/grpo/metrics.jsonl" "$OUT/quickstart_metrics.jsonl" 2>/dev/null
$PY - "$qs/grpo/metrics.jsonl" <<'EOF' 2>&1 | tee -a "$OUT/quickstart.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
acc = [r["val/acc"] for r in rows if "val/acc" in r]
steps = [r["timing/step"] for r in rows if "timing/step" in r]
print(f"quickstart on GPU: val/acc first {acc[0]:.3f} last {acc[-1]:.3f} best {max(acc):.3f}; "
      f"{len(steps)} steps, median timing/step {statistics.median(steps):.3f} s")
EOF

timeout 70 $PY bench/sampler.py --model tiny --quick --device cuda > "$OUT/sampler_tiny.log" 2>&1
stamp "sampler tiny rc=$?"
timeout 70 $PY bench/sampler.py --model tiny --quick --device cuda --compile > "$OUT/sampler_tiny_graphs.log" 2>&1
stamp "sampler tiny graphs rc=$?"
timeout 100 $PY bench/sampler.py --model 100m --device cuda --compile --batches 1,64,256 \
  > "$OUT/sampler_100m_graphs.log" 2>&1
stamp "sampler 100m graphs rc=$?"
