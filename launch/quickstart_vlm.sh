#!/usr/bin/env bash
# The vision-language quickstart on CPU: a tiny Qwen2.5-VL built by the project learns to count the
# shapes in a picture (the prompt text is the same for every row: only the image tells). SFT on a
# hasty teacher that undercounts crowded pictures, then GRPO; a picture of a few validation images
# with the answers before and after RL. Extra arguments go to train_grpo.py as overrides.
#
#   bash launch/quickstart_vlm.sh                # 2 processes (NPROC=1 for one)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -m rlhf.data.shapes --out data/shapes
python -m rlhf.models.tiny_vlm --out outputs/quickstart_vlm/init --hf-init
torchrun --standalone --nproc_per_node="$NPROC" train_sft.py --config configs/quickstart_vlm_sft.yaml
torchrun --standalone --nproc_per_node="$NPROC" train_grpo.py --config configs/quickstart_vlm.yaml "$@"
python scripts/vlm_answers.py --data data/shapes/val.parquet --out outputs/quickstart_vlm/answers.png \
  --model "after SFT=outputs/quickstart_vlm/sft/hf_export" --model "after GRPO=outputs/quickstart_vlm/grpo/hf_export"
