"""Speculative decoding (``rlhf.rollout.speculative``): the acceptance rule keeps the target's distribution
(chi-square over many draws of a small vocabulary), n-gram drafts, and the real sampler producing the
same tokens and log-probs with speculation on as off (greedy and sampled; paged cache, prefix sharing,
preemption, multi-turn parking)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlhf.config.load import load_config
from rlhf.rollout import SamplingParams
from rlhf.rollout.drafts import ngram_drafts
from rlhf.rollout.engine import global_rollout_stats
from rlhf.rollout.speculative import SPEC_STATS, verify_tokens
from rlhf.schema.config import ConfigError
from tests.unit.test_sampler import PROMPTS, _sampler
from tests.unit.test_sampler_turns import PARAMS as TURN_PARAMS, FakeTool

V = 12  # vocabulary of the statistical tests
DRAWS = 40_000
SPEC = SimpleNamespace(enable=True, num_draft_tokens=4, ngram_min=1, ngram_max=3, sources=["siblings", "self"])


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution ``[V]`` (temperature, then HF's top-k / top-p rules), by hand."""
    p = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_k > 0:
        p = torch.where(p >= p.topk(params.top_k).values[-1], p, 0.0)
        p = p / p.sum()
    order = p.argsort(descending=True, stable=True)
    before = p[order].cumsum(0) - p[order]
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order] = before < params.top_p
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _chi2_same(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` drawn from ``probs`` (categories of probability 0 must have no counts)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1  # Pearson's chi-square; p-value = the upper regularised gamma Q(df/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.7),
                                    SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["t1", "top_p", "top_k_top_p"])
def test_acceptance_rule_keeps_the_target_distribution(params):
    """One drafted position, many uniforms: the first emitted token ~ p0 whatever the draft, the
    acceptance rate is p0(draft), a rejection's token ~ p0 without the draft (the residual
    norm(max(p0 - onehot, 0))), and after an accepted draft the next token ~ p1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=gen) * 1.5
    p0, p1 = _target(logits[0], params), _target(logits[1], params)
    x = int(p0.argsort(descending=True)[1])  # a likely but not the likeliest draft
    u = 1.0 - torch.rand(DRAWS, 2, generator=gen)  # (0, 1]
    drafts = torch.full((DRAWS, 1), x)
    tok, logp, emitted = verify_tokens(logits[None].expand(DRAWS, 2, V), drafts, params, u)
    first = tok[:, 0]
    assert _chi2_same(torch.bincount(first, minlength=V), p0) > 1e-3
    accepted = first == x
    assert torch.equal(emitted >= 2, accepted)
    rate = accepted.double().mean()
    assert abs(rate - p0[x]) < 4 * (p0[x] * (1 - p0[x]) / DRAWS) ** 0.5
    residual = p0.clone()
    residual[x] = 0
    assert _chi2_same(torch.bincount(first[~accepted], minlength=V), residual / residual.sum()) > 1e-3
    assert _chi2_same(torch.bincount(tok[accepted, 1], minlength=V), p1) > 1e-3
    # log-probs are the target's (temperature-scaled, untruncated)
    ref = torch.log_softmax(logits[0] / params.temperature, dim=-1)[first]
    assert torch.allclose(logp[:, 0], ref, atol=1e-6)


def test_greedy_accepts_iff_the_draft_is_the_argmax():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]]).expand(3, 3, 3)
    drafts = torch.tensor([[1, 0], [1, 2], [2, 0]])
    tok, _, emitted = verify_tokens(logits, drafts, SamplingParams(temperature=0.0), None)
    assert emitted.tolist() == [3, 2, 1]
    assert tok[:, 0].tolist() == [1, 1, 1] and tok[0].tolist() == [1, 0, 2]


def test_ngram_drafts_longest_match_with_the_most_following_tokens():
    corpus = torch.tensor([[[5, 6, 7, 8, 9, 1], [1, 6, 7, 2, -1, -1]],
                           [[4, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 3]]])
    known = torch.tensor([[6, 4], [6, 6]])
    context = torch.tensor([[9, 6, 7], [-1, 8, 8]])
    drafts, lengths = ngram_drafts(context, corpus, known, [1, 2, 3], k=3)
    # row 0: "6 7" occurs twice; the first row's continuation (8 9 1) is the longer known one
    assert drafts[0].tolist() == [8, 9, 1] and lengths[0] == 3
    assert drafts[1].tolist() == [-1, -1, -1] and lengths[1] == 0  # no match
    drafts, lengths = ngram_drafts(torch.tensor([[0, 7]]), corpus[:1], torch.tensor([[6, 4]]), [1], k=4)
    assert drafts.tolist() == [[8, 9, 1, -1]] and lengths.tolist() == [3]  # stops at the known end


def _same(a, b) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_lengths, b.response_lengths) and torch.equal(a.response_mask, b.response_mask)
    assert torch.allclose(a.log_probs, b.log_probs, atol=1e-5)


PAGED = dict(kv_cache_tokens=64, max_seq_len=40, max_num_seqs=6, block_size=4)
GREEDY = SamplingParams(n=3, temperature=0.0, max_new_tokens=24, seed=1, stop_token_ids=[17])
CASES = {
    "greedy": (GREEDY, {}),
    "top_p_stop_seq": (SamplingParams(n=3, temperature=1.0, top_p=0.8, max_new_tokens=24, seed=1,
                                      stop_sequences=[[3, 4]]), {}),
    # paged blocks of 4: the prompts' full blocks are shared by their samples; a small budget preempts
    "greedy_paged_preempt": (GREEDY, PAGED),
    "sampled_paged_preempt": (SamplingParams(n=3, temperature=0.3, max_new_tokens=24, seed=2, stop_token_ids=[17]),
                              PAGED),
}


@pytest.mark.parametrize("case", CASES)
def test_sampler_same_tokens_and_logprobs_with_speculation(case):
    params, kw = CASES[case]
    off = _sampler(**kw).generate(PROMPTS[:3], params)
    on = _sampler(speculative=SPEC, **kw).generate(PROMPTS[:3], params)
    _same(off, on)
    assert on.stats["spec_accepted"] > 0 and on.stats["spec_tokens_per_forward"] > 1.0
    if params.greedy:  # greedy drafts from repeating text pay: fewer forwards
        assert on.stats["decode_steps"] < off.stats["decode_steps"]
    if kw:
        assert on.stats["preemptions"] > 0 and on.stats["kv_shared_blocks"] > 0


def test_multi_turn_parking_same_trajectories_with_speculation():
    params = dataclasses.replace(TURN_PARAMS, temperature=1.0)
    kw = dict(kv_cache_tokens=96, max_num_seqs=6)
    off = _sampler(**kw).generate(PROMPTS, params, turns=FakeTool(delay=1))
    on = _sampler(speculative=SPEC, **kw).generate(PROMPTS, params, turns=FakeTool(delay=1))
    _same(off, on)
    assert on.stats["turns"] > 4 and on.stats["spec_accepted"] > 0 and on.stats["parked_preemptions"] > 0


def test_config_and_global_metrics():
    req = ["model.path=/m", "data.train_files=/d.parquet"]
    cfg = load_config(None, req + ["rollout.speculative.enable=true", "rollout.speculative.num_draft_tokens=6"])
    assert cfg.rollout.speculative.enable and cfg.rollout.speculative.num_draft_tokens == 6
    assert not load_config(None, req).rollout.speculative.enable  # off by default
    with pytest.raises(ConfigError, match="rollout.speculative.ngram_min"):
        load_config(None, req + ["rollout.speculative.ngram_min=4"])
    with pytest.raises(ConfigError, match="rollout.speculative.sources"):
        load_config(None, req + ["rollout.speculative.sources=[others]"])
    with pytest.raises(ConfigError, match="unknown config key 'rollout.speculative.num_drafts'"):
        load_config(None, req + ["rollout.speculative.num_drafts=2"])
    local = dict(zip(SPEC_STATS, (10.0, 4.0, 3.0, 12.0, 8.0)), seconds=1.0)
    out = global_rollout_stats(local, None, speculative=True)
    assert out["spec_acceptance_rate"] == 0.4 and out["spec_tokens_per_forward"] == 1.5
    assert "spec_acceptance_rate" not in global_rollout_stats(local, None)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "deepseek_v3"])
def test_sliding_window_and_softcap_model_same_tokens_with_speculation(kind):
    """Gemma 2 (4-token sliding window, soft-capped attention and logits): the verify forward's masks;
    GPT-OSS: its attention sinks over the folded query rows of the verify forward; DeepSeek-V3: its MLA
    heads (v narrower than the cache head) through the verify forward."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16, seed=1)
    off = _sampler(kind).generate(PROMPTS[:3], params)
    on = _sampler(kind, speculative=SPEC).generate(PROMPTS[:3], params)
    _same(off, on)
    assert on.stats["spec_accepted"] > 0
