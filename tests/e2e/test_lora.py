"""LoRA end to end: adapters only are trained and moved; the reference is the adapter-free base."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from rlhf.models.lora import apply_lora
from rlhf.ops.metrics import read_metrics
from tests.e2e.conftest import grpo_args, run_script


def _rows(path):
    return [m for m in read_metrics(path) if "actor/loss" in m]


def test_lora_moves_only_adapters(tiny_assets, tmp_path, parity_reward):
    over = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.use_kl_loss": True, "actor.lr": 1e-2,
            "reward.reward_fn": parity_reward}
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "lora", **over), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("train_grpo.py", grpo_args(tiny_assets, tmp_path / "full"), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    lora, full = _rows(tmp_path / "lora" / "metrics.jsonl"), _rows(tmp_path / "full" / "metrics.jsonl")

    peft = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_assets / "model"), lora_rank=4, lora_alpha=8)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in peft.named_parameters() if ".lora_" in n)
    base_bytes = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(
        tiny_assets / "model").parameters())
    # Each of 2 ranks holds half of every adapter and receives the other half; the base
    # weights were gathered once, before step 1's timing window, and are cached.
    for m in lora:
        assert m["reshard/bytes_received"] == adapter_bytes / 2
    assert full[0]["reshard/bytes_received"] == base_bytes / 2
    # The reference is the base model: KL to it is 0 before the first update, > 0 after.
    assert lora[0]["actor/kl_to_ref"] == 0.0 and lora[1]["actor/kl_to_ref"] > 0.0
