"""How many [tokens, vocab / tp] fp32 tensors the log-prob pass and the update hold at their peak.

    python bench/sim_logit_units.py        # tp 1 / 2, entropy on / off, padded / packed, T = 1 / 0.7

Simulates rank 0 of 8 (``python -m rlhf.simulate`` in a fresh process each, device cuda: bf16
logits) of a model whose logits dwarf everything else (vocab 65,536, hidden 64, 2 layers), 4 rows
of 64 + 192 tokens, and prints each phase's peak minus parameters, gradients and AdamW state in
units of ``rows x response x vocab / tp x 4`` bytes: the constants of the planner's logits terms
(rlhf/planner/plan.py, docs/memory.md). The remainder (hidden states, FSDP2 blocks) is ~0.05 units.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [[], ["model.use_remove_padding=false"], ["rollout.temperature=0.7"], ["actor.entropy_coeff=0.01"],
         ["parallel.tp=2"], ["parallel.tp=2", "actor.entropy_coeff=0.01"]]
ROWS, P, R, V = 4, 64, 192, 65536


def main() -> None:
    from rlhf.models.tiny import tiny_qwen2_config

    with tempfile.TemporaryDirectory() as d:
        tiny_qwen2_config(V, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                          intermediate_size=128).save_pretrained(d)
        base = [f"model.path={d}", "data.train_files=x", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                f"data.max_prompt_length={P}", f"data.max_response_length={R}", "rollout.n=1", "rollout.tp=1",
                f"actor.ppo_micro_batch_size_per_gpu={ROWS}", f"actor.log_prob_micro_batch_size_per_gpu={ROWS}",
                "actor.use_dynamic_bsz=false", "model.fsdp_unit=block", "model.use_remove_padding=true"]
        print("| overrides | log-prob pass | update |")
        print("|---|---|---|")
        for case in CASES:
            out = subprocess.run([sys.executable, "-m", "rlhf.simulate", "--world", "8", "--json", *base, *case],
                                 cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                                 text=True, check=True)
            sim = json.loads(out.stdout.strip().splitlines()[-1])
            tp = 2 if "parallel.tp=2" in case else 1
            unit = ROWS * R * V / tp * 4
            units = [(p["total"] - p["parameters"] - p["optimizer"] - p["gradients"]) / unit
                     for p in (sim["peaks"]["log-probs"], sim["peaks"]["update"])]
            print(f"| {' '.join(case) or '(tp 1, packed, T 1, no entropy bonus)'} | {units[0]:.2f} | {units[1]:.2f} |")


if __name__ == "__main__":
    main()
