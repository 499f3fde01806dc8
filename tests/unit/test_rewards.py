"""Rule-based reward functions, the registry, and batch scoring."""

import math

import pytest
import torch

from rlhf.rewards import extract_solution, get_reward_fn, list_reward_fns, score_responses


@pytest.mark.parametrize(
    "text, gt, strict, flexible",
    [
        ("so the answer is\n#### 72", "72", 1.0, 1.0),
        ("#### 1,234", "1234", 1.0, 1.0),
        ("#### 7 then #### 72", "72", 1.0, 1.0),  # the last #### wins
        ("#### 72 and 5 more", "72", 1.0, 0.0),  # flexible takes the last number
        ("the answer is 72", "72", 0.0, 1.0),  # no #### -> strict 0
        ("####72", "72", 0.0, 1.0),  # strict needs "#### " with a space (as verl)
        ("#### 71", "72", 0.0, 0.0),
        ("#### -3", "-3", 1.0, 1.0),
        ("no numbers here.", "1", 0.0, 0.0),
        ("costs $1,000 total", "1000", 0.0, 1.0),
    ],
)
def test_gsm8k_strict_and_flexible(text, gt, strict, flexible):
    assert get_reward_fn("gsm8k")("openai/gsm8k", text, gt) == strict
    assert get_reward_fn("gsm8k_flexible")("openai/gsm8k", text, gt) == flexible


def test_gsm8k_format_score_and_clip():
    fn = get_reward_fn("gsm8k", {"format_score": 0.1})
    assert fn("openai/gsm8k", "#### 71", "72") == 0.1  # answer present but wrong
    assert fn("openai/gsm8k", "72", "72") == 0.0  # no answer at all: 0, not format_score
    assert fn("openai/gsm8k", "#### 72", "72") == 1.0
    # like verl, only the last 300 characters are searched
    assert get_reward_fn("gsm8k")("x", "#### 72" + " " * 400, "72") == 0.0
    assert extract_solution("a #### 5,000.5 b") == "5000.5"


def test_exact_match_and_default():
    em = get_reward_fn("exact_match")
    assert em("x", "  Paris\n", "Paris") == 1.0 and em("x", "paris", "Paris") == 0.0
    default = get_reward_fn("default")
    assert default("openai/gsm8k", "#### 3", "3") == 1.0
    assert default("synthetic/addition", "5+6=11;1+2+1=4 #### 41", "41") == 1.0
    with pytest.raises(NotImplementedError, match="no default reward for data_source 'foo/bar'.*openai/gsm8k"):
        default("foo/bar", "#### 3", "3")


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match="unknown reward function 'gsm9k'.*gsm8k_flexible"):
        get_reward_fn("gsm9k")
    assert {"gsm8k", "gsm8k_flexible", "exact_match", "default"} <= set(list_reward_fns())


USER_FILE = '''
def my_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(len(solution_str)) + bonus, "length": len(solution_str), "note": "text"}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5

def _private():
    pass
'''


def test_user_function_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    fn = get_reward_fn(f"{path}:my_reward")
    assert fn("d", "abc", "x") == {"score": 3.0, "length": 3, "note": "text"}
    assert get_reward_fn(f"{path}:my_reward", {"bonus": 1.0})("d", "abc", "x")["score"] == 4.0
    assert get_reward_fn(str(path))("d", "abc", "x") == 0.5  # verl's default name compute_score
    with pytest.raises(AttributeError, match=r"'nope' not found.*\['compute_score', 'my_reward'\]"):
        get_reward_fn(f"{path}:nope")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        get_reward_fn(f"{tmp_path / 'missing.py'}:f")


def test_score_responses_dict_metrics(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(USER_FILE)
    fn = get_reward_fn(f"{path}:my_reward")
    res = score_responses(fn, ["ab", "abcd"], ["1", "2"], ["d", "d"], [None, {}])
    assert torch.equal(res.scores, torch.tensor([2.0, 4.0]))
    assert res.scores.dtype == torch.float32
    assert res.extra_metrics == {"length": [2.0, 4.0]}  # "note" is not numeric: not a metric
    assert res.metric_means() == {"reward/length": 3.0}
    assert res.n_errors == 0 and res.first_error is None


def test_score_responses_counts_errors_and_nonfinite():
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("bad parse")
        if solution_str == "nan":
            return float("nan")
        if solution_str == "inf":
            return {"score": math.inf, "m": 1.0}
        if solution_str == "str":
            return "1.0"
        if solution_str == "noscore":
            return {"acc": 1.0}
        return {"score": 1.0, "m": 2.0}

    res = score_responses(flaky, ["ok", "boom", "nan", "inf", "str", "noscore"], ["1"] * 6, ["d"] * 6, None)
    assert res.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert res.n_errors == 5
    assert res.first_error == "sample 1 (data_source=d): RuntimeError: bad parse"
    m = res.extra_metrics["m"]
    assert m[0] == 2.0 and all(math.isnan(v) for v in m[1:])


def test_score_responses_gsm8k_batch_and_length_check():
    res = score_responses(get_reward_fn("gsm8k"), ["#### 1", "#### 2", "3"], ["1", "1", "3"], ["d"] * 3)
    assert res.scores.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="aligned"):
        score_responses(get_reward_fn("gsm8k"), ["a"], ["1", "2"], ["d"])


def test_reward_components_for_gdpo_in_key_order_and_named_when_missing():
    from rlhf.rewards.scoring import reward_components, score_responses
    from rlhf.schema.config import ConfigError

    def fn(ds, s, gt, extra):
        if s == "boom":
            raise RuntimeError("bad")
        return {"score": 1.0, "fmt": float(len(s)), "acc": float(s == gt)}

    res = score_responses(fn, ["ab", "boom", "x"], ["ab", "y", "y"], ["d"] * 3)
    comp = reward_components(res, ["acc", "fmt"])
    assert comp.tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 1.0]]  # the failed sample: 0 (and counted)
    assert res.n_errors == 1
    with pytest.raises(ConfigError, match=r"returned no \['len'\].*'acc', 'fmt'"):
        reward_components(res, ["acc", "len"])


def test_extra_metric_means_merge_over_ranks_like_one_batch():
    from rlhf.rewards.scoring import ScoreResult, mean_of_sums

    nan = math.nan
    whole = ScoreResult(torch.zeros(5), {"fmt": [1.0, 0.0, nan, 1.0, 1.0], "len": [4.0, nan, nan, 2.0, 3.0]})
    # Two ranks' halves; the first reported no "len" at all, the second no "fmt" on one sample.
    a = ScoreResult(torch.zeros(2), {"fmt": [1.0, 0.0]})
    b = ScoreResult(torch.zeros(3), {"fmt": [nan, 1.0, 1.0], "len": [nan, 2.0, 3.0]})
    b_len_only_row0 = ScoreResult(torch.zeros(1), {"len": [4.0]})
    want = {"reward/fmt": 3 / 4, "reward/len": 9 / 3}
    assert whole.metric_means() == want
    assert mean_of_sums([a.metric_sums(), b.metric_sums(), b_len_only_row0.metric_sums()]) == want
    assert mean_of_sums([ScoreResult(torch.zeros(1), {"x": [nan]}).metric_sums()]) == {}
