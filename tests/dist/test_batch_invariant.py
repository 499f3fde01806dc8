"""rollout.batch_invariant: over GRPO steps of the quickstart config (tiny models), every response token's
sampler log-prob equals the trainer's bit for bit (``torch.equal``), on 1 rank and on dp2, for Qwen2 and
Qwen3-MoE; the first mini-batch's update forward reproduces the old log-probs exactly (ratio 1.0); with
``actor.use_rollout_log_probs`` the old-log-prob pass does not run and the sampler's log-probs are the old ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist._dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# (model, actor.use_rollout_log_probs)
CASES = [("qwen2", False), ("qwen3_moe", False), ("qwen2", True)]


def _write_moe(d: Path) -> None:
    """A tiny Qwen3-MoE (a dense layer, top-2 of 8 experts) with the quickstart's character tokenizer."""
    import transformers

    from rlhf.data.char_tokenizer import build_char_tokenizer
    from tests._archs import tiny_config

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, num_hidden_layers=2, mlp_only_layers=[1])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from tests._assets import write_tiny_assets

    d = tmp_path_factory.mktemp("bi")
    write_tiny_assets(d, n_train=32, n_val=8)
    _write_moe(d / "qwen3_moe")
    return d


def _run(workdir: Path, model: str, use_rollout_lp: bool, world: int) -> dict:
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    path = workdir / "model" if model == "qwen2" else workdir / model
    overrides = [
        f"model.path={path}", f"data.train_files={workdir / 'data' / 'train.parquet'}", f"data.val_files={workdir / 'data' / 'val.parquet'}", "trainer.test_freq=-1",
        "data.max_response_length=8", "data.train_batch_size=4", "rollout.n=4", "rollout.batch_invariant=true",
        f"actor.use_rollout_log_probs={str(use_rollout_lp).lower()}", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.log_prob_micro_batch_size_per_gpu=8", "trainer.logger=[]",
        f"trainer.total_training_steps={STEPS}", f"trainer.output_dir={workdir / f'{model}_{use_rollout_lp}_{world}'}",
        "checkpoint.export_hf=false",
    ]
    trainer = RLTrainer(load_config(str(ROOT / "configs" / "quickstart.yaml"), overrides))
    actor, rec = trainer.actor, {"old_equal": [], "first_equal": [], "passes": 0, "diff": []}
    state = {"opt": 0, "start": 0}
    step, loss, compute, update = actor.optimizer.step, actor._loss, actor.compute_log_probs, trainer.update_actor

    def counted_step(*a, **k):
        state["opt"] += 1
        return step(*a, **k)

    def checked_loss(log_probs, entropy, mask, old, *a, **k):  # the first mini-batch: the old log-probs' weights
        if state["opt"] == state["start"]:
            m = mask.bool()
            rec["first_equal"].append(torch.equal(log_probs.detach()[m], old[m]))
        return loss(log_probs, entropy, mask, old, *a, **k)

    def counted_pass(*a, **k):
        rec["passes"] += 1
        return compute(*a, **k)

    def marked_update(batch):
        m = batch.response_mask.bool()
        rec["old_equal"].append(torch.equal(batch.old_log_probs[m], batch.rollout_log_probs[m]))
        state["start"] = state["opt"]
        return update(batch)

    actor.optimizer.step, actor._loss, actor.compute_log_probs = counted_step, checked_loss, counted_pass
    trainer.update_actor = marked_update
    for s in range(1, STEPS + 1):
        metrics = trainer.train_step(s)
        rec["diff"].append(metrics.get("mismatch/max_abs_logprob_diff"))
    trainer.close()
    return rec


def _worker(rank: int, world: int, workdir: Path, out: str) -> None:
    results = {case: _run(workdir, *case, world) for case in CASES}
    torch.save(results, f"{out}.rank{rank}")


@pytest.mark.parametrize("world", [1, 2])
def test_sampler_log_probs_equal_trainer_bitwise(workdir, world):
    run_distributed(_worker, world, workdir, str(workdir / f"out{world}"), timeout_s=300)
    for rank in range(world):
        results = torch.load(f"{workdir / f'out{world}'}.rank{rank}", weights_only=False)
        for (model, skip), rec in results.items():
            name = f"{model} use_rollout_log_probs={skip} world={world} rank={rank}"
            assert rec["old_equal"] == [True] * STEPS, f"{name}: old log-probs differ from the sampler's"
            assert rec["first_equal"] and all(rec["first_equal"]), f"{name}: first mini-batch ratio is not 1.0"
            if skip:
                assert rec["passes"] == 0, f"{name}: the old-log-prob pass ran"
                assert rec["diff"] == [None] * STEPS
            else:
                assert rec["passes"] == STEPS
                assert rec["diff"] == [0.0] * STEPS, f"{name}: mismatch/max_abs_logprob_diff {rec['diff']}"
