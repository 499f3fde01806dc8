"""Math rewards: `math` (last \\boxed{} judged by math-verify) and `math_dapo` (DAPO's Answer: line)."""

import sys
import threading

import pytest

from rlhf.rewards import math_answer
from rlhf.rewards.math_answer import extract_boxed_answer, last_boxed_only_string
from rlhf.rewards.math_dapo import normalize_final_answer
from rlhf.rewards.registry import get_reward_fn

pytest.importorskip("math_verify")

# (boxed answer in the response, ground truth): equivalent forms that must score 1.
EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("1/2", "\\frac12"),
    ("0.5", "\\frac{1}{2}"),
    ("0.50", "1/2"),
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("\\tfrac{3}{4}", "0.75"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
    ("50\\%", "0.5"),
    ("50\\%", "50"),
    ("10\\text{ cm}", "10"),
    ("10 \\mbox{ inches}", "10"),
    ("90^\\circ", "90"),
    ("\\$5", "5"),
    ("1,000", "1000"),
    ("3.0", "3"),
    ("x=3", "3"),
    ("(1,2]", "(1, 2]"),
    ("(-\\infty, 3)", "(-\\infty,3)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("2 + 3i", "3i+2"),
    ("10^{3}", "1000"),
    ("\\text{(B)}", "B"),
]

# near misses that must score 0.
DIFFERENT = [
    ("[1,2]", "(1,2]"),  # closed vs half-open interval
    ("(1,2)", "[1,2]"),
    ("2", "-2"),
    ("3", "3.5"),
    ("12", "21"),
    ("\\frac{2}{3}", "\\frac{3}{2}"),
    ("0.333", "\\frac13"),  # a rounded decimal is not the fraction
    ("\\sqrt{2}", "1.414"),
    ("B", "C"),
    ("2\\sqrt{3}", "3\\sqrt{2}"),
]


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_math_equivalent_forms_match(pred, gold):
    out = get_reward_fn("math")("lighteval/MATH", f"so the answer is $\\boxed{{{pred}}}$.", gold)
    assert out["score"] == 1.0 and out["acc"] == 1.0 and out["pred"] == pred


@pytest.mark.parametrize("pred,gold", DIFFERENT)
def test_math_near_misses_do_not_match(pred, gold):
    out = get_reward_fn("math")("lighteval/MATH", f"\\boxed{{{pred}}}", gold)
    assert out["score"] == 0.0 and out["acc"] == 0.0


def test_math_uses_last_complete_box_and_needs_one():
    fn = get_reward_fn("math")
    assert fn("m", "first \\boxed{3}, corrected: \\boxed{4}", "4")["score"] == 1.0
    assert fn("m", "first \\boxed{4}, corrected: \\boxed{3}", "4")["score"] == 0.0
    assert fn("m", "the answer is 4", "4") == {"score": 0.0, "acc": 0.0, "pred": None}
    assert fn("m", "\\boxed{\\frac{1}{2", "1/2")["pred"] is None  # cut inside the box
    # a list of accepted answers (the dataset loader stores lists JSON-encoded) and a boxed gold solution
    assert fn("m", "\\boxed{7}", '["6", "7"]')["score"] == 1.0
    assert fn("m", "\\boxed{7}", "so $x = \\boxed{7}$")["score"] == 1.0


def test_boxed_extraction():
    assert last_boxed_only_string("a \\boxed{\\frac{1}{2}} b") == "\\boxed{\\frac{1}{2}}"
    assert extract_boxed_answer("\\fbox{12}") == "12"
    assert extract_boxed_answer("\\boxed 5$") == "5"
    assert extract_boxed_answer("\\boxed{a{b}c} and \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed_answer("no box") is None


@pytest.mark.parametrize("response,gold,score", [
    ("work...\nAnswer: 34", "34", 1.0),
    ("work...\nanswer:  1,000", "1000", 1.0),
    ("Answer: 5\nthen more thought\nAnswer: 6", "6", 1.0),  # the last Answer: line counts
    ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0),
    ("Answer: 12 dollars", "12", 1.0),
    ("Answer: \\boxed{7}", "7", 1.0),
    ("Answer: x = 9", "9", 1.0),
    ("Answer: 35", "34", -1.0),
    ("the answer is 34", "34", -1.0),  # no Answer: line
    ("Answer: 3.5", "35", -1.0),
])
def test_math_dapo(response, gold, score):
    out = get_reward_fn("math_dapo")("math_dapo", response, gold)
    assert out["score"] == score and out["acc"] == (score > 0)
    if "answer:" not in response.lower():
        assert out["pred"] == "[INVALID]"


def test_math_dapo_reads_only_the_tail():
    long = "Answer: 34\n" + "x" * 400
    assert get_reward_fn("math_dapo")("math_dapo", long, "34")["score"] == -1.0


def test_normalize_final_answer():
    assert normalize_final_answer("\\text{5 units}") == "5"
    assert normalize_final_answer("\\frac12") == "\\frac{1}{2}"
    assert normalize_final_answer("$10,000$") == "10000"


@pytest.mark.parametrize("source,expected", [
    ("openai/gsm8k", 1.0), ("lighteval/MATH", 1.0), ("DigitalLearningGmbH/MATH-lighteval", 1.0),
    ("HuggingFaceH4/MATH-500", 1.0), ("math_dapo", 1.0), ("aime_2024", 1.0), ("aime25", 1.0)])
def test_default_dispatch_by_data_source(source, expected):
    response = "#### 12\n\\boxed{12}\nAnswer: 12"
    out = get_reward_fn("default")(source, response, "12")
    assert (out["score"] if isinstance(out, dict) else out) == expected
    wrong = get_reward_fn("default")(source, "#### 13\n\\boxed{13}\nAnswer: 13", "12")
    wrong = wrong["score"] if isinstance(wrong, dict) else wrong
    assert wrong == (-1.0 if source.startswith(("aime", "math_dapo")) else 0.0)


def test_missing_math_verify_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[math\]\""):
        get_reward_fn("math")("lighteval/MATH", "\\boxed{1}", "1")


def test_math_verify_timeouts_are_passed_in_main_thread_only(monkeypatch):
    seen = []
    import math_verify

    def parse(text, parsing_timeout=None):
        seen.append(("parse", parsing_timeout))
        return [text]

    def verify(gold, pred, timeout_seconds=None):
        seen.append(("verify", timeout_seconds))
        return True

    monkeypatch.setattr(math_verify, "parse", parse)
    monkeypatch.setattr(math_verify, "verify", verify)
    assert math_answer.answers_equivalent("1", "1", timeout_s=3)
    assert seen == [("parse", 3), ("parse", 3), ("verify", 3)]
    seen.clear()
    # SIGALRM-based timeouts cannot be installed off the main thread: they are turned off there.
    t = threading.Thread(target=math_answer.answers_equivalent, args=("1", "1"))
    t.start()
    t.join()
    assert seen == [("parse", None), ("parse", None), ("verify", None)]
