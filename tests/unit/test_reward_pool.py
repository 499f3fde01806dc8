"""Reward worker pool: same scores as in-process scoring; hangs, crashes and exceptions score 0,
are counted, and do not stop the batch."""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch

from rlhf.rewards.pool import RewardPool, SerialScorer, make_scorer
from rlhf.rewards.registry import get_reward_fn, register_reward_fn
from rlhf.rewards.scoring import score_responses

REWARD = textwrap.dedent("""
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(3600)
        if solution_str == "crash":
            os._exit(3)
        if solution_str == "raise":
            raise ValueError("bad answer")
        return {"score": float(len(solution_str)), "acc": float(solution_str == ground_truth), "pred": solution_str[:2]}
""")


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return str(path)


def batch(texts):
    return texts, ["abc"] * len(texts), ["src"] * len(texts), [{"i": i} for i in range(len(texts))]


def test_pool_equals_in_process_scoring(spec):
    texts = [("x" * (i % 7)) + "abc" for i in range(40)] + ["abc", "raise"]
    want = score_responses(get_reward_fn(spec), *batch(texts))
    with RewardPool(spec, num_workers=3, timeout_s=30) as pool:
        got = pool.score(*batch(texts))
    assert torch.equal(got.scores, want.scores)
    assert got.extra_metrics == want.extra_metrics
    assert got.preds == want.preds
    assert (got.n_errors, got.n_timeouts) == (1, 0) == (want.n_errors, want.n_timeouts)
    assert "ValueError: bad answer" in got.first_error


def test_hang_and_crash_score_zero_are_counted_and_the_rest_is_scored(spec):
    texts = ["ab", "hang", "abcd", "crash", "a", "hang", "abc"]
    t0 = time.monotonic()
    with RewardPool(spec, num_workers=2, timeout_s=1.0) as pool:
        res = pool.score(*batch(texts))
        restarts = pool.restarts
        # Replaced workers serve the next batch.
        again = pool.score(*batch(["abc", "abcde"]))
    elapsed = time.monotonic() - t0
    assert res.scores.tolist() == [2.0, 0.0, 4.0, 0.0, 1.0, 0.0, 3.0]
    assert (res.n_timeouts, res.n_errors) == (2, 1)
    assert restarts == 3
    assert again.scores.tolist() == [3.0, 5.0] and again.n_errors == again.n_timeouts == 0
    # A liveness bound, not a speed claim: a hung call sleeps an hour, so without the timeout the test
    # would take that long; two 1 s timeouts plus worker start-ups take seconds (34 s seen under load 25).
    assert elapsed < 300, elapsed


def test_submit_then_result_overlaps_and_keeps_tickets_apart(spec):
    with RewardPool(spec, num_workers=2, timeout_s=30) as pool:
        t1 = pool.submit(*batch(["a", "ab"]))
        t2 = pool.submit(*batch(["abc"]))
        assert pool.result(t2).scores.tolist() == [3.0]
        assert pool.result(t1).scores.tolist() == [1.0, 2.0]


def test_function_registered_only_in_this_process_fails_with_the_fix(tmp_path):
    register_reward_fn("only_here_for_the_pool_test")(lambda ds, s, gt, extra=None: 1.0)
    with RewardPool("only_here_for_the_pool_test", num_workers=1, timeout_s=5) as pool:
        with pytest.raises(RuntimeError, match="reward.num_workers: 0"):
            pool.score(*batch(["a"]))


def test_bad_spec_fails_at_construction_and_serial_scorer_is_the_zero_worker_choice(spec):
    with pytest.raises(ValueError, match="unknown reward function"):
        RewardPool("no_such_reward", num_workers=1, timeout_s=5)
    scorer = make_scorer(spec, num_workers=0, timeout_s=5)
    assert isinstance(scorer, SerialScorer)
    assert scorer.score(*batch(["abc"])).scores.tolist() == [3.0]


def test_close_ends_the_workers(spec):
    pool = RewardPool(spec, num_workers=2, timeout_s=5)
    pool.score(*batch(["a"]))
    procs = [w.proc for w in pool._workers]
    pool.close()
    assert all(p.poll() is not None for p in procs)
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


KWARG_REWARD = textwrap.dedent("""
    def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=0.0):
        return {"score": scale * len(solution_str) + bonus, "bonus_seen": bonus}
""")


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_kwargs_reach_the_function_serial_and_in_workers(tmp_path, workers):
    from rlhf.config.load import load_config

    (tmp_path / "r.py").write_text(KWARG_REWARD)
    cfg = load_config(None, ["model.path=/m", "data.train_files=/d", f"reward.reward_fn={tmp_path}/r.py:scaled",
                             "reward.reward_kwargs={scale: 2.0, bonus: 0.5}"])
    assert cfg.reward.reward_kwargs == {"scale": 2.0, "bonus": 0.5}
    scorer = make_scorer(cfg.reward.reward_fn, num_workers=workers, timeout_s=30,
                         reward_kwargs=cfg.reward.reward_kwargs)
    try:
        res = scorer.score(*batch(["ab", "abcd"]))
    finally:
        scorer.close()
    assert res.scores.tolist() == [4.5, 8.5] and res.extra_metrics["bonus_seen"] == [0.5, 0.5]
    assert res.n_errors == 0


def test_reward_kwargs_the_function_does_not_take_fail_at_start(tmp_path):
    (tmp_path / "r.py").write_text(KWARG_REWARD)
    with pytest.raises(TypeError, match="reward.reward_kwargs.*'sclae'"):
        get_reward_fn(f"{tmp_path}/r.py:scaled", {"sclae": 2.0})


def test_a_batch_that_takes_long_prints_its_progress(spec, capsys, monkeypatch):
    """issue 33 item 6: a hanging reward function costs timeouts one after the other; while the batch
    is scored a line says how far it got (rank 0), instead of silence until the step ends."""
    monkeypatch.setenv("RANK", "0")
    with RewardPool(spec, num_workers=1, timeout_s=1.0) as pool:
        pool.progress_s = 0.5
        res = pool.score(*batch(["hang", "hang", "ab"]))
    assert res.n_timeouts == 2 and res.scores.tolist() == [0.0, 0.0, 2.0]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rlhf] reward: ")]
    assert lines and "samples of this batch done on rank 0 so far" in lines[-1], lines
    assert "timed out after reward.timeout_s=1 s each" in lines[-1]


def test_a_step_whose_every_call_hangs_costs_one_timeout_round(spec):
    """issue 55: with fail_fast (the trainer sets it at every step), once every worker has timed out in a
    step and no call answered, the step's remaining calls fail at once, counted as untried timeouts;
    a later submit of the same step (streamed scoring) fails at once too; the next step tries again,
    and a call that answers keeps the rule from tripping."""
    with RewardPool(spec, num_workers=2, timeout_s=1.0) as pool:
        pool.score(*batch(["ab"]))  # workers started
        pool.set_fail_fast(True)  # a step starts
        res = pool.score(*batch(["hang"] * 8))
        assert res.n_timeouts == 8 and res.scores.tolist() == [0.0] * 8
        # one round: a call per worker tried (and at most one more per worker that started late), the rest not
        assert 4 <= res.n_untried <= 6, (res.n_untried, res.first_error)
        later = pool.score(*batch(["ab", "hang"]))  # the same step: nothing more is tried
        assert (later.n_timeouts, later.n_untried, later.scores.tolist()) == (2, 2, [0.0, 0.0])
        assert "not tried: 2 calls timed out after 1 s (reward.timeout_s) in this step" in later.first_error
        pool.set_fail_fast(True)  # the next step
        mixed = pool.score(*batch(["ab", "abc", "hang", "hang", "hang", "abcd"]))
    assert (mixed.n_timeouts, mixed.n_untried) == (3, 0)
    assert mixed.scores.tolist() == [2.0, 3.0, 0.0, 0.0, 0.0, 4.0]


def test_worker_interpreters_import_neither_torch_nor_pyarrow():
    # Every trainer starts reward.num_workers (+ tool) interpreters per rank; one that imports torch
    # costs ~1.5 s of CPU each (a regression once made `rlhf.rewards` pull torch in through `rlhf.data`).
    import subprocess
    import sys

    code = ("import sys, rlhf.rewards.worker, rlhf.agent.tool_worker\n"
            "from rlhf.rewards.registry import get_reward_fn\n"
            "[get_reward_fn(s) for s in ('gsm8k', 'math_dapo')]\n"
            "print(sorted(m for m in ('torch', 'pyarrow', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
