#!/usr/bin/env bash
# The CPU quickstart, end to end: build the project's tiny model and task, warm-start the
# model with SFT on a flawed teacher's demonstrations, then GRPO with a verifiable reward.
# About 4 minutes on 2 idle CPU cores (docs/getting-started/quickstart.md has the measured times); it scales
# with the cores it gets. Extra arguments go to train_grpo.py as overrides.
#
#   bash launch/quickstart.sh                    # 2 processes (NPROC=1 for one)
#   bash launch/quickstart.sh actor.lr=5e-5
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -m rlhf.data.synthetic --out data/addition --n-sft 8000
python -m rlhf.models.tiny --out outputs/quickstart/init
torchrun --standalone --nproc_per_node="$NPROC" train_sft.py --config configs/quickstart_sft.yaml
torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart.yaml "$@"
python scripts/plot_metrics.py outputs/quickstart/grpo/metrics.jsonl --out outputs/quickstart/grpo/curve.png \
  --keys val/acc reward/mean
