#!/usr/bin/env bash
# Run an entry script on this machine with all its GPUs (or N CPU processes).
#
#   bash launch/local.sh configs/quickstart.yaml                       # train_grpo.py
#   SCRIPT=train_ppo.py NPROC=4 bash launch/local.sh configs/quickstart_ppo.yaml actor.lr=1e-6
#   MAX_RESTARTS=2 bash launch/local.sh x.yaml   # a crashed rank restarts the job, which resumes from
#                                                # the last complete checkpoint (checkpoint.resume: auto)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: launch/local.sh CONFIG.yaml [key=value ...]}
shift
SCRIPT=${SCRIPT:-train_grpo.py}
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
exec torchrun --standalone --nproc_per_node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}" \
  "$SCRIPT" --config "$CONFIG" "$@"
