#!/usr/bin/env bash
# The tools quickstart on CPU: a multiplication task a tiny model cannot solve without a calculator,
# a supervised warm start on multi-turn tool-use demonstrations, then GRPO with the calculator
# tool, and the same GRPO budget without tools for comparison. Extra arguments go to both GRPO runs.
#
#   bash launch/quickstart_tools.sh              # 2 processes (NPROC=1 for one)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -m rlhf.data.arithmetic --out data/multiplication
python -m rlhf.models.tiny --out outputs/quickstart_tools/init
torchrun --standalone --nproc_per_node="$NPROC" train_sft.py --config configs/quickstart_tools_sft.yaml
torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart_tools.yaml "$@"
torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart_tools.yaml \
  rollout.multi_turn.enable=false trainer.output_dir=outputs/quickstart_tools/no_tools "$@"
