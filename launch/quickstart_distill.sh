#!/usr/bin/env bash
# On-policy distillation on the CPU quickstart task: build the task, the SFT warm start and the
# teacher (the GRPO quickstart's final model; skipped when outputs/quickstart/grpo/hf_export
# exists), then distil the teacher into the student (the SFT warm start) with
# configs/quickstart_distill.yaml. Metrics: outputs/quickstart/distill/metrics.jsonl.
# Extra arguments go to the distillation run as overrides.
#
#   bash launch/quickstart_distill.sh                  # 2 processes (NPROC=1 for one)
#   bash launch/quickstart_distill.sh rollout.n=2
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -m rlhf.data.synthetic --out data/addition --n-sft 8000
if [ ! -f outputs/quickstart/grpo/hf_export/config.json ]; then
  python -m rlhf.models.tiny --out outputs/quickstart/init
  torchrun --standalone --nproc_per_node="$NPROC" train_sft.py --config configs/quickstart_sft.yaml
  torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart.yaml
fi
torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart_distill.yaml "$@"
python scripts/plot_metrics.py outputs/quickstart/distill/metrics.jsonl --out outputs/quickstart/distill/curve.png \
  --keys val/acc distill/reverse_kl
