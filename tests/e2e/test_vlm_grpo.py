"""GRPO end to end on a tiny random Qwen2.5-VL with images in verl's schema (1 CPU process): the
built-in sampler runs the vision tower and M-RoPE, and its log-probs equal the trainer's recomputed
ones on image prompts (``rollout/logprob_diff_max``: a sampler that ignored the images, or placed
them at the wrong rotary positions, would be off by ~1e-1)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import run_script, train_steps

pytest.importorskip("PIL")

REWARD = '''
def char_parity(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2)  # varied over a random model's samples
'''


def _assets(root):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from rlhf.models.tiny_vlm import write_tiny_vlm

    write_tiny_vlm(str(root / "model"), "qwen2_5_vl")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):  # three image prompts and a text-only one
        im = Image.fromarray((torch.rand(16 + 8 * (i % 2), 16, 3, generator=g) * 255).byte().numpy())
        im.save(root / f"im{i}.png")
        text, images = (f"text only {i}", []) if i == 3 else (f"<image>What is {i}?", [{"bytes": None,
                                                                                    "path": f"im{i}.png"}])
        rows.append({"prompt": [{"role": "user", "content": text}], "images": images, "data_source": "t",
                     "reward_model": {"ground_truth": str(i)}})
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "reward.py").write_text(REWARD)


def test_vlm_grpo_steps_run_on_the_sampler_with_images(tmp_path):
    _assets(tmp_path)
    args = {"model.path": tmp_path / "model", "data.train_files": tmp_path / "train.parquet", "data.val_files": "",
            "data.max_prompt_length": 48, "data.max_response_length": 8, "data.train_batch_size": 4,
            "rollout.n": 2, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4,
            "actor.lr": 1e-3, "trainer.device": "cpu", "trainer.output_dir": tmp_path / "out",
            "trainer.total_training_steps": 2, "checkpoint.export_hf": False,
            "reward.reward_fn": f"{tmp_path / 'reward.py'}:char_parity", "reward.num_workers": 0}
    r = run_script("train_grpo.py", [f"{k}={v}" for k, v in args.items()])
    assert r.returncode == 0, r.stderr[-3000:]
    steps = train_steps(tmp_path / "out" / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["rollout/logprob_diff_max"] < 1e-4, m["rollout/logprob_diff_max"]
        assert m["rollout/tokens_generated"] > 0 and m["actor/grad_norm"] > 0
