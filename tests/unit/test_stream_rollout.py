"""StreamRun (trainer.mode fully_async's sampler run): streaming groups, continuous refill, and
partial rollout across a weight load, checked against teacher-forced forwards of each weight set."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf.rollout import Sampler, SamplingParams
from rlhf.rollout.stream import STOP, StreamPrompt, StreamRun

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5], [33, 34, 35, 36]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7)
STEP = 3


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    return transformers.Qwen2ForCausalLM(cfg).eval()


A, B = _model(1234), _model(99)


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


class Driver:
    """Feeds PROMPTS in order; the ``push_at``-th poll brings ``new`` weights as version 1."""

    def __init__(self, new=None, push_at: int = -1):
        self.todo = [StreamPrompt(p, key=10 + i, step=STEP, tag=i) for i, p in enumerate(PROMPTS)]
        self.groups: dict[int, dict] = {}
        self.polls, self.new, self.push_at = 0, new, push_at

    def poll_weights(self, block):
        self.polls += 1
        if self.polls == self.push_at:
            return 1, dict(self.new.state_dict())
        if len(self.groups) == len(PROMPTS) and not self.todo:
            return STOP
        return None

    def next_prompts(self, free, version):
        out, self.todo = self.todo[:free], self.todo[free:]
        return out

    def on_group(self, prompt, out):
        self.groups[prompt.tag] = out


def _run(driver: Driver, **kw) -> dict:
    s = Sampler(A.config, A.state_dict(), pad_token_id=0, max_num_seqs=3)
    stats = StreamRun(s, PARAMS, groups=2, driver=driver, max_prompt_len=8, **kw).execute()
    assert sorted(driver.groups) == list(range(len(PROMPTS)))
    return stats


_PLAIN: list[tuple[Driver, dict]] = []


def _plain() -> Driver:
    """The run without a weight push (shared by the tests that compare against it)."""
    if not _PLAIN:
        d = Driver()
        _PLAIN.append((d, _run(d)))
    return _PLAIN[0]


def _rows(driver: Driver):
    for i, p in enumerate(PROMPTS):
        g = driver.groups[i]
        for j in range(PARAMS.n):
            n = int(g["lengths"][j])
            yield p, g["response_ids"][j, :n].tolist(), g["log_probs"][j, :n], g["versions"][j, :n]


def test_streamed_groups_with_refill_equal_one_batched_generate():
    ref = Sampler(A.config, A.state_dict(), pad_token_id=0).generate(PROMPTS, PARAMS, step=STEP,
                                                                    prompt_keys=[10 + i for i in range(5)])
    d, stats = _plain()  # 2 group slots, 3 sequence slots: groups stream out and slots refill
    assert stats["groups"] == 5 and stats["weight_loads"] == 0
    for i in range(len(PROMPTS)):
        for j in range(PARAMS.n):
            row = i * PARAMS.n + j
            assert d.groups[i]["response_ids"][j].tolist() == ref.response_ids[row].tolist()
            # other batch shapes than the reference's: fp32 round-off
            torch.testing.assert_close(d.groups[i]["log_probs"][j], ref.log_probs[row], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_pause_with_the_same_weights_changes_no_token(kv):
    plain, paused = _plain()[0], Driver(new=A, push_at=6)
    stats = _run(paused, kv=kv)
    assert stats["pauses"] == 1 and stats["paused_sequences"] > 0
    for (_, r0, lp0, _), (_, r1, lp1, v1) in zip(_rows(plain), _rows(paused)):
        assert r0 == r1
        torch.testing.assert_close(lp0, lp1, atol=1e-6, rtol=0)
    assert any(bool((v == 1).any()) and bool((v == 0).any()) for *_, v in _rows(paused))  # a token-boundary split


def test_recompute_resumes_under_a_fresh_prefill_of_the_new_weights():
    d = Driver(new=B, push_at=6)
    _run(d, kv="recompute")
    split = 0
    for p, r, lp, ver in _rows(d):
        old, new = ver == 0, ver == 1
        assert bool((ver[1:] >= ver[:-1]).all())  # one switch, old -> new
        split += bool(old.any() and new.any())
        torch.testing.assert_close(lp[old], _teacher_forced(A, p, r)[old], atol=1e-5, rtol=0)
        torch.testing.assert_close(lp[new], _teacher_forced(B, p, r)[new], atol=1e-5, rtol=0)
    assert split > 0


def test_keep_continues_on_the_stale_cache():
    d = Driver(new=B, push_at=6)
    _run(d, kv="keep")
    stale = 0
    for p, r, lp, ver in _rows(d):
        old, new = ver == 0, ver == 1
        torch.testing.assert_close(lp[old], _teacher_forced(A, p, r)[old], atol=1e-5, rtol=0)
        if old.any() and new.any():  # B's logits over K/V that A wrote: neither weight set's forward
            stale += int(((lp[new] - _teacher_forced(B, p, r)[new]).abs() > 1e-4).sum())
    assert stale > 0


def test_without_partial_rollout_new_weights_wait_for_the_sequences_in_flight():
    d = Driver(new=B, push_at=6)
    stats = _run(d, partial_rollout=False)
    assert stats["weight_loads"] == 1 and stats["pauses"] == 0
    for p, r, lp, ver in _rows(d):
        assert bool((ver == ver[0]).all())  # every sample single-version
        ref = A if int(ver[0]) == 0 else B
        torch.testing.assert_close(lp, _teacher_forced(ref, p, r), atol=1e-5, rtol=0)
