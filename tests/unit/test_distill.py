"""On-policy distillation math (rlhf/algos/distill.py, the opd estimator) and the cross-tokenizer map."""

import math

import pytest
import torch

from rlhf.algos.advantages import get_adv_estimator
from rlhf.algos.cross_tokenizer import map_by_spans, piece_spans
from rlhf.algos.distill import add_opd_term, distill_sums, generalized_jsd, opd_advantages, reverse_kl


def _batch(seed=0, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    student = torch.log_softmax(torch.randn(B, T, 7, generator=g), -1)[..., 0]
    teacher = torch.log_softmax(torch.randn(B, T, 7, generator=g), -1)[..., 0]
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)  # holes
    return student, teacher, mask


def test_teacher_equal_student_gives_exactly_zero():
    student, _, mask = _batch()
    adv, ret = get_adv_estimator("opd")(token_level_rewards=torch.ones_like(mask), response_mask=mask,
                                        old_log_probs=student, teacher_log_probs=student.clone())
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.equal(ret, adv)
    base = torch.randn(3, 5)
    assert torch.equal(add_opd_term(base, student, student.clone(), mask, 0.7), base)
    logits = torch.randn(3, 5, 11)
    for beta in (0.0, 0.3, 1.0):
        assert torch.equal(generalized_jsd(logits, logits.clone(), mask, beta=beta), torch.zeros(3, 5))
    assert distill_sums(student, student, mask)[0].item() == 0.0


def test_reverse_kl_hand_computed():
    # student p = (0.5, 0.25) on the sampled tokens, teacher q = (0.25, 0.5); token 3 is a tool output
    s = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    t = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    m = torch.tensor([[1.0, 1.0, 0.0]])
    kl = reverse_kl(s, t, m)
    assert kl.tolist()[0][:2] == pytest.approx([math.log(2), -math.log(2)]) and kl[0, 2] == 0
    adv, _ = opd_advantages(s, t, m)
    assert adv.tolist()[0] == pytest.approx([-math.log(2), math.log(2), 0.0])
    # additive form: A - coef * KL on scored tokens only
    out = add_opd_term(torch.full((1, 3), 1.0), s, t, m, coef=0.5)
    assert out.tolist()[0] == pytest.approx([1 - 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1.0])
    sums = distill_sums(s, t, m)
    assert sums.tolist() == pytest.approx([0.0, math.log(0.25) + math.log(0.5), 2.0])


def test_full_distribution_reverse_kl_matches_sampled_expectation():
    """The k1 estimate's expectation under the student is the reverse KL of the distributions."""
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    expected = float((p * (p.log() - q.log())).sum())
    kl = reverse_kl(p.log().unsqueeze(0), q.log().unsqueeze(0), torch.ones(1, 3))
    assert float((p * kl[0]).sum()) == pytest.approx(expected)
    logits_s, logits_t = p.log().view(1, 1, 3), q.log().view(1, 1, 3)
    assert generalized_jsd(logits_s, logits_t, torch.ones(1, 1), beta=1.0).item() == pytest.approx(expected)
    fwd = float((q * (q.log() - p.log())).sum())
    assert generalized_jsd(logits_s, logits_t, torch.ones(1, 1), beta=0.0).item() == pytest.approx(fwd)


def test_generalized_jsd_hand_computed_and_differentiable():
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])  # teacher, student
    m = 0.5 * p + 0.5 * q
    hand = 0.5 * float((p * (p / m).log()).sum()) + 0.5 * float((q * (q / m).log()).sum())
    s_logits = q.log().view(1, 1, 2).requires_grad_()
    out = generalized_jsd(s_logits, p.log().view(1, 1, 2), torch.ones(1, 1), beta=0.5)
    assert out.item() == pytest.approx(hand, rel=1e-5)
    out.sum().backward()
    assert s_logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s_logits, s_logits, torch.ones(1, 1), beta=1.5)


def test_opd_needs_teacher_log_probs():
    with pytest.raises(ValueError, match="distill.enabled"):
        get_adv_estimator("opd")(token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2),
                                 old_log_probs=torch.zeros(1, 2))


def test_cross_tokenizer_map_sums_covering_teacher_tokens_and_masks_crossings():
    # text "12+34": student tokens "1","2","+","34"; teacher tokens "12","+3","4"
    student = piece_spans(["1", "2", "+", "34"])
    teacher = piece_spans(["12", "+3", "4"])
    vals, ok = map_by_spans(student, teacher, [-0.5, -1.0, -0.25])
    # "12" covers two student tokens -> no per-token value; "+3" crosses a boundary -> "+" and "34" masked
    assert ok == [False, False, False, False]
    # a teacher finer than the student: "34" = "3" + "4", summed
    vals, ok = map_by_spans(student, piece_spans(["1", "2", "+", "3", "4"]), [float("nan"), -1.0, -2.0, -0.5, -0.25])
    assert ok == [False, True, True, True] and vals[1:] == pytest.approx([-1.0, -2.0, -0.75])
    # mixed: teacher "1","2+","3","4" -> "2" and "+" masked, "34" = sum
    vals, ok = map_by_spans(student, piece_spans(["1", "2+", "3", "4"]), [-0.1, -0.2, -0.3, -0.4])
    assert ok == [True, False, False, True] and vals[0] == pytest.approx(-0.1) and vals[3] == pytest.approx(-0.7)


def test_cross_tokenizer_retokenize_round_trip_with_tokenizers_library():
    """A second tokenizer built with `tokenizers` (digit pairs merged): the student's rows re-tokenized
    for it, and a teacher that scores every teacher token -1 maps back to -(teacher tokens per student token)."""
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.schema.batch import RolloutBatch
    from rlhf.train.distill import map_back, retokenize
    from tests._assets import digit_pair_tokenizer

    student, teacher = build_char_tokenizer(), digit_pair_tokenizer()
    assert teacher.get_vocab() != student.get_vocab()
    prompt, response = "<|user|>12+3=", "#### 15<eos>"
    p_ids = student(prompt, add_special_tokens=False)["input_ids"]
    r_ids = student(response, add_special_tokens=False)["input_ids"]
    P, R = len(p_ids) + 1, len(r_ids) + 2
    ids = torch.zeros(1, P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    ids[0, 1:P] = torch.tensor(p_ids)
    ids[0, P:P + len(r_ids)] = torch.tensor(r_ids)
    attn[0, 1:P + len(r_ids)] = 1
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, P:], response_mask=attn[:, P:].float(),
                         index=torch.zeros(1, dtype=torch.long), rollout_log_probs=torch.zeros(1, R),
                         truncated=torch.zeros(1, dtype=torch.bool))
    tb, maps = retokenize(batch, student, teacher)
    t_text = teacher.decode(tb.input_ids[0][tb.attention_mask[0].bool()].tolist(), skip_special_tokens=False)
    assert t_text.replace(" ", "") == (prompt + response).replace(" ", "")
    lp = -tb.response_mask.clone()
    out, valid = map_back(lp, tb, maps, batch)
    # "####" "15" -> "15" is one teacher token covering two student tokens: masked; "#", " ", "<eos>" map 1:1
    got = [(student.decode([t]), bool(v), float(x)) for t, v, x in zip(r_ids, valid[0].tolist(), out[0].tolist())]
    assert got == [("#", True, -1.0)] * 4 + [(" ", True, -1.0), ("1", False, 0.0), ("5", False, 0.0),
                                             ("<eos>", True, -1.0)]
    assert not valid[0, len(r_ids):].any()  # padding


def test_memory_plan_counts_teachers_sharded_like_the_reference():
    from rlhf.config.load import load_config
    from rlhf.planner import ModelShape, plan_memory

    tiny = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 10, "hidden_size": 4,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "tie_word_embeddings": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
    student, big = ModelShape.from_config_dict(tiny), ModelShape.from_config_dict({**tiny, "num_hidden_layers": 6})
    base = ["model.path=x", "data.train_files=x", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=opd", "distill.enabled=true", "distill.teachers.big.path=y",
            "distill.teachers.small.path=z", "distill.teachers.small.dtype=bfloat16"]
    p = plan_memory(student, load_config(None, base), world_size=2, device="cpu",
                    teacher_shapes={"big": big, "small": student})
    # fp32 big teacher + bf16 copy of the student's shape, each sharded over dp=2
    assert p.components["distill teachers"] == big.num_params() / 2 * 4 + student.num_params() / 2 * 2
    assert p.phases["update"]["distill teachers"] == p.components["distill teachers"]
    off = plan_memory(student, load_config(None, base + ["distill.teachers.big.param_offload=true"]), world_size=2,
                      device="cpu", teacher_shapes={"big": big, "small": student})
    assert off.components["distill teachers"] == student.num_params() / 2 * 2
    assert off.host["distill teachers (offloaded)"] == big.num_params() / 2 * 4


def test_config_teachers_by_name_and_start_up_errors():
    from rlhf.config.load import load_config
    from rlhf.schema.config import ConfigError
    from rlhf.train.distill import check_routing

    base = ["model.path=x", "data.train_files=x"]
    cfg = load_config(None, base + ["algorithm.adv_estimator=opd", "distill.enabled=true",
                                    "distill.teachers.big.path=/t", "distill.teachers.big.dtype=bfloat16",
                                    "distill.data_source_teacher={a/b: big}"])
    assert cfg.distill.teachers["big"].path == "/t" and cfg.distill.teachers["big"].dtype == "bfloat16"
    assert cfg.distill.data_source_teacher == {"a/b": "big"}
    with pytest.raises(ConfigError, match=r"distill.teachers.big.pth.*did you mean distill.teachers.big.path"):
        load_config(None, base + ["distill.teachers.big.pth=/t"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator.*distill.enabled=true"):
        load_config(None, base + ["algorithm.adv_estimator=opd"])
    with pytest.raises(ConfigError, match="distill.teachers.*needs a teacher"):
        load_config(None, base + ["distill.enabled=true"])
    with pytest.raises(ConfigError, match="distill.teachers.big.path.*required"):
        load_config(None, base + ["distill.teachers.big.dtype=float32"])
    with pytest.raises(ConfigError, match="no teacher named 'small'"):
        check_routing({"a": "small"}, ["big"], {"a"})
    with pytest.raises(ConfigError, match="data_source.*c of data.train_files have no teacher"):
        check_routing({"a": "big"}, ["big", "small"], {"a", "c"})
    check_routing({}, ["big"], {"a", "c"})  # one teacher: every row goes to it


def test_quickstart_distill_config_loads():
    from pathlib import Path

    from rlhf.config.load import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_distill.yaml"))
    assert cfg.algorithm.adv_estimator == "opd" and cfg.rollout.n == 1 and cfg.distill.enabled
    assert cfg.distill.teachers["teacher"].path == "outputs/quickstart/grpo/hf_export"
    assert cfg.trainer.output_dir == "outputs/quickstart/distill"
