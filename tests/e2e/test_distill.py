"""On-policy distillation end to end (tiny random models, 2 steps each, one interpreter for all runs).

* opd, teacher = the student: every advantage and the loss are exactly 0;
* opd, teacher = the student under a permuted-id tokenizer (the cross-tokenizer path, every span
  mapped): the same teacher log-probs, so the reverse KL is ~0 and nothing is unmapped;
* opd, a character-pair tokenizer teacher (built with `tokenizers`): two-character tokens cover two
  student tokens, so those spans are masked and counted;
* grpo with the additive term from another teacher: the KL moves the advantages;
* a LoRA student, and trainer.mode one_step_off on 2 ranks (the teacher runs on the training rank).
"""

from __future__ import annotations

import math

import pytest

from rlhf.ops.metrics import read_metrics
from tests._assets import write_digit_pair_teacher
from tests.e2e.conftest import grpo_args, run_script, run_script_many


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    from rlhf.models.tiny import write_permuted_vocab_copy, write_tiny_model

    d = tmp_path_factory.mktemp("distill")
    student = tiny_assets / "model"
    permuted = write_permuted_vocab_copy(str(student), str(d / "permuted"))
    # pairs of any letter or digit: a random student's text has many, so some spans never map
    pairs = write_digit_pair_teacher(d / "pairs", pairs_of="0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    other = write_tiny_model(str(d / "other"), seed=5, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64)
    opd = {"algorithm.adv_estimator": "opd", "distill.enabled": True, "rollout.n": 1, "data.train_batch_size": 8}
    cases = {
        "self": {**opd, "distill.teachers.t.path": student},
        "permuted": {**opd, "distill.teachers.t.path": permuted},
        "pairs": {**opd, "distill.teachers.t.path": pairs},
        "additive": {"distill.enabled": True, "distill.teachers.t.path": other, "distill.distillation_loss_coef": 0.5},
        "lora": {**opd, "distill.teachers.t.path": other, "model.lora_rank": 8},
    }
    args = [grpo_args(tiny_assets, d / name, **{"data.val_files": "", **over}) for name, over in cases.items()]
    return d, dict(zip(cases, run_script_many("train_grpo.py", args, timeout=900)))


def _rows(runs, name):
    d, results = runs
    assert results[name].returncode == 0, results[name].stderr[-3000:]
    rows = [m for m in read_metrics(d / name / "metrics.jsonl") if "actor/loss" in m]
    assert [m["step"] for m in rows] == [1, 2]
    return rows


def test_teacher_equal_student_gives_zero_advantages_and_loss(runs):
    first = _rows(runs, "self")[0]
    assert first["distill/reverse_kl"] == 0.0 and first["advantage/mean"] == 0.0 and first["actor/loss"] == 0.0
    assert first["distill/scored_tokens"] > 0 and first["distill/unmapped_tokens"] == 0.0


def test_cross_tokenizer_path_maps_a_permuted_vocabulary_exactly(runs):
    first = _rows(runs, "permuted")[0]
    assert abs(first["distill/reverse_kl"]) < 1e-5 and first["distill/unmapped_tokens"] == 0.0
    assert first["distill/teacher_logprob_mean"] == pytest.approx(_rows(runs, "self")[0]["distill/teacher_logprob_mean"],
                                                                  abs=1e-5)


def test_cross_tokenizer_masks_and_counts_unmapped_spans(runs):
    for m in _rows(runs, "pairs"):
        assert m["distill/unmapped_tokens"] > 0 and m["distill/scored_tokens"] > 0
        assert math.isfinite(m["distill/reverse_kl"]) and math.isfinite(m["actor/loss"])


def test_additive_term_on_grpo(runs):
    for m in _rows(runs, "additive"):
        assert m["distill/reverse_kl"] != 0 and m["distill/coef"] == 0.5 and m["actor/grad_norm"] > 0


def test_lora_student(runs):
    rows = _rows(runs, "lora")  # the teacher is a separate full model, never the adapter-free actor
    # the k1 estimate of one sample per token can be negative; it is 0 only where the teacher is the student
    assert all(m["distill/reverse_kl"] != 0 and m["actor/grad_norm"] > 0 for m in rows)


def test_one_step_off_teacher_on_the_training_rank(tiny_assets, tmp_path):
    from rlhf.models.tiny import write_tiny_model

    other = write_tiny_model(str(tmp_path / "other"), seed=5, hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64)
    out = tmp_path / "one_step_off"
    r = run_script("train_grpo.py", grpo_args(tiny_assets, out, **{
        "trainer.mode": "one_step_off", "actor.tis_imp_ratio_cap": 2.0, "data.val_files": "", "algorithm.adv_estimator": "opd", "rollout.n": 1,
        "distill.enabled": True, "distill.teachers.t.path": other}), nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(out / "metrics.jsonl") if "actor/loss" in m]
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["distill/reverse_kl"] != 0 and m["distill/scored_tokens"] > 0 for m in rows)
