"""rollout.batch_invariant (rlhf/models/batch_invariant.py): a row's bits do not depend on the batch; the
sampler's log-probs equal the installed trainer forward's bit for bit (Qwen2, Qwen3-MoE) and match HF's
forward to fp32 rounding; the layouts and families outside the mode are refused in one line."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rlhf.models import batch_invariant as bi
from rlhf.models.logprobs import position_ids_from_mask, token_log_probs
from tests._archs import tiny_config


def test_tiled_rows_do_not_depend_on_the_batch():
    """A row's linear / log-prob in row tiles is the same bits in any batch (sizes 1 .. 70, any order)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 96, generator=g), torch.randn(160, 96, generator=g)
    labels = torch.randint(0, 160, (70,), generator=g)
    full = bi.by_tiles(lambda t: F.linear(t, w), x)
    lp_full, _ = bi.row_log_probs(full, labels, 0.7)
    for size in (1, 3, 16, 17, 40):
        rows = torch.randperm(70, generator=g)[:size]
        out = bi.by_tiles(lambda t: F.linear(t, w), x[rows])
        assert torch.equal(out, full[rows]), size
        assert torch.equal(bi.row_log_probs(out, labels[rows], 0.7)[0], lp_full[rows]), size
    torch.testing.assert_close(lp_full, token_log_probs(x @ w.t(), labels, 0.7)[0], atol=1e-5, rtol=0)


def test_attention_by_length_equals_per_sequence_and_the_cache_read():
    """The trainer's packed-sequence attention and a decode over a cache give the same bits per query, and equal
    causal SDPA to fp32 rounding."""
    spec = bi.DecoderSpec.from_config(tiny_config("qwen3_moe"))
    g = torch.Generator().manual_seed(1)
    lens = [5, 9, 3]
    positions = torch.cat([torch.arange(n) for n in lens])
    hall = spec.num_heads + 2 * spec.num_kv_heads
    qkv = torch.randn(sum(lens), hall, spec.head_dim, generator=g)
    out = bi._sequence_attend(spec, qkv, positions, 0.25)  # [M, H * D]
    # the last token of each sequence as a decode step over that sequence's cache
    h, hkv = spec.num_heads, spec.num_kv_heads
    ends = torch.tensor(lens).cumsum(0) - 1
    starts = ends - torch.tensor(lens) + 1
    width = max(lens)
    k = torch.zeros(len(lens), hkv, width, spec.head_dim)
    v = torch.zeros_like(k)
    for s, (a, n) in enumerate(zip(starts.tolist(), lens)):
        k[s, :, :n] = qkv[a:a + n, h:h + hkv].transpose(0, 1)
        v[s, :, :n] = qkv[a:a + n, h + hkv:].transpose(0, 1)
    dec = bi.attend_by_length(bi._heads(spec, qkv.index_select(0, ends)), torch.tensor(lens),
                              lambda rows, n: (k[rows, :, :n], v[rows, :, :n]), 0.25).reshape(len(lens), -1)
    assert torch.equal(dec, out.index_select(0, ends))
    a, n = starts[1].item(), lens[1]
    q = qkv[a:a + n, :h].transpose(0, 1)
    kk = qkv[a:a + n, h:h + hkv].transpose(0, 1).repeat_interleave(h // hkv, 0)
    vv = qkv[a:a + n, h + hkv:].transpose(0, 1).repeat_interleave(h // hkv, 0)
    ref = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=0.25).transpose(0, 1).reshape(n, -1)
    torch.testing.assert_close(out[a:a + n], ref, atol=1e-5, rtol=0)


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":  # the shared tiny sizes as a dense Qwen2 (q/k/v biases)
        from transformers import Qwen2Config

        base = tiny_config("qwen3_moe")
        cfg = Qwen2Config(**{k: getattr(base, k) for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                                           "num_key_value_heads", "max_position_embeddings",
                                                           "pad_token_id", "eos_token_id")},
                          num_hidden_layers=2, intermediate_size=128)
    else:
        cfg = tiny_config(kind, num_hidden_layers=2, mlp_only_layers=[1])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return cfg, model


def _rows(prompts, out, n):
    """[left-padded prompt | right-padded response] rows and masks of a generate output."""
    width, r = max(len(p) for p in prompts), out.response_ids.shape[1]
    ids, mask = [], []
    for i in range(out.response_ids.shape[0]):
        p, n_resp = prompts[i // n], int(out.response_mask[i].sum())
        ids.append([0] * (width - len(p)) + p + out.response_ids[i].tolist())
        mask.append([0] * (width - len(p)) + [1] * (len(p) + n_resp) + [0] * (r - n_resp))
    return torch.tensor(ids), torch.tensor(mask)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_sampler_log_probs_equal_the_trainer_forward(kind):
    from rlhf.rollout import Sampler, SamplingParams

    cfg, model = _model(kind)
    weights = {k: t.detach().clone() for k, t in model.state_dict().items()}
    prompts = [[2, 3, 4, 5, 6], [7, 8], list(range(10, 29))]
    # qwen2: the 19-token prompt prefilled in chunks of 8 (prefill_chunk), with top-p
    sampler = Sampler(cfg, weights, pad_token_id=0, batch_invariant=True, prefill_tokens=8 if kind == "qwen2" else 8192)
    out = sampler.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=3,
                                                   top_p=0.9 if kind == "qwen2" else 1.0))
    ids, mask = _rows(prompts, out, 2)
    r = out.response_ids.shape[1]
    with torch.no_grad():  # HF's own forward: the invariant one is the same function to fp32 rounding
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    hf, _ = token_log_probs(logits[:, -r - 1:-1], ids[:, -r:], 0.8)
    bi.install(model, cfg)
    lp, _ = bi.invariant_log_probs(model, ids, mask, response_length=r, temperature=0.8)  # with autograd
    m = out.response_mask.bool()
    assert torch.equal(lp[m], out.log_probs[m])
    torch.testing.assert_close(lp[m].detach(), hf[m], atol=1e-4, rtol=0)
    lp[m].sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_refusals_are_one_line(tmp_path):
    from rlhf.config.load import load_config
    from rlhf.schema.config import ConfigError

    base = ["model.path=m", "data.train_files=x.parquet", "rollout.batch_invariant=true"]
    for extra, words in ((["parallel.tp=2"], "parallel.tp = rollout.tp = 1"),
                         (["rollout.speculative.enable=true"], "rollout.speculative"),
                         (["actor.router_replay=R3"], "router_replay=none"),
                         (["trainer.mode=one_step_off"], "colocated"),
                         (["rollout.quantization=fp8"], "rollout.quantization=fp8 rounds them")):
        with pytest.raises(ConfigError, match="rollout.batch_invariant") as e:
            load_config(None, base + extra)
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="actor.use_rollout_log_probs"):
        load_config(None, base[:2] + ["actor.use_rollout_log_probs=true"])
    cfg = tiny_config("gemma2")
    with pytest.raises(ValueError, match="rollout.batch_invariant: model_type 'gemma2'"):
        bi.install(AutoModelForCausalLM.from_config(cfg), cfg)


def test_a_nonzero_difference_warns_once():
    bi._WARNED.clear()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert bi.step_metrics(0.0, "qwen2", "cpu") == {"mismatch/max_abs_logprob_diff": 0.0}
        bi.step_metrics(2e-7, "qwen2", "cpu")
        bi.step_metrics(3e-7, "qwen2", "cpu")
    lines = [str(w.message) for w in got if issubclass(w.category, bi.MismatchWarning)]
    assert len(lines) == 1 and "qwen2" in lines[0] and "2e-07" in lines[0]
