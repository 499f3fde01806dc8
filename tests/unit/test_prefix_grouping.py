"""Prefix-grouped padding-free passes (``model.prefix_grouping``) equal the ungrouped ones.

A GRPO group's shared prompt is forwarded once and its responses attend to its K/V
(:mod:`rlhf.models.prefix_grouping`). Log-probs, entropies, values and gradients must match
the plain packed pass at 1e-6 (fp32: outputs elementwise at rtol = atol = 1e-6; a gradient tensor
within 1e-6 of its largest entry, since a shared prompt's gradient is summed in another order) on
batches with holes: groups of different sizes and
prompt lengths, a singleton group, an empty (filtered) response, an attention-mask hole inside
a response, groups cut by micro-batch boundaries and by dynamic (token-budget) batching.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import rlhf.models.varlen_attention as va
from rlhf.models.packed import packed_forward_log_probs, packed_forward_values
from rlhf.models.prefix_grouping import (AUTO_GPU_MIN_SAVED_WORK, group_by_prompt, resolve_mode, shared_prompt_tokens,
                                         should_group)
from rlhf.models.tiny import tiny_qwen2_config
from rlhf.schema.config import ConfigError
from tests._archs import tiny_model

TOL = dict(rtol=1e-6, atol=1e-6)


def assert_grad_close(got: torch.Tensor, ref: torch.Tensor, name: str = "") -> None:
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert err <= 1e-6 * max(scale, 1.0), f"{name}: max |grouped - ungrouped| = {err:.2e}, largest entry {scale:.2e}"
GROUPS = ((3, 7), (4, 5), (1, 9), (2, 3))  # (samples, prompt tokens) per group
P, R = 9, 6


def grpo_rows(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one group are contiguous and share their left-padded prompt; responses of 0..R tokens."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for n, plen in GROUPS:
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for _ in range(n):
            rl = int(torch.randint(1, R + 1, (1,), generator=g))
            row, m = torch.zeros(P + R, dtype=torch.long), torch.zeros(P + R, dtype=torch.long)
            row[P - plen:P], m[P - plen:P] = prompt, 1
            row[P:P + rl], m[P:P + rl] = torch.randint(3, vocab, (rl,), generator=g), 1
            ids.append(row)
            mask.append(m)
    ids, mask = torch.stack(ids), torch.stack(mask)
    mask[1, P:], ids[1, P:] = 0, 0  # a filtered sample: no response at all
    mask[4, P + 1], mask[4, P + 2:P + 4] = 0, 1  # an attention-mask hole inside a response
    return ids, mask


def _run(model, ids, mask, grouping, fn=packed_forward_log_probs):
    model.zero_grad(set_to_none=True)
    if fn is packed_forward_values:
        out = (fn(model, ids, mask, response_length=R, prefix_grouping=grouping),)
    else:
        out = fn(model, ids, mask, response_length=R, temperature=0.7, compute_entropy=True, prefix_grouping=grouping)
    w = torch.linspace(-1, 1, out[0].numel()).view_as(out[0])
    sum((o * w).sum() for o in out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in out], grads


def _assert_same(model, ids, mask, fn=packed_forward_log_probs):
    row = group_by_prompt(ids, mask, R)
    assert row.saved == sum((n - 1) * plen for n, plen in GROUPS) and row.total < int(mask.sum())
    (ref, ref_g), (got, got_g) = _run(model, ids, mask, False, fn), _run(model, ids, mask, True, fn)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert ref_g.keys() == got_g.keys() and ref_g
    for name in ref_g:
        assert_grad_close(got_g[name], ref_g[name], name)


def _qwen2(**kw):
    torch.manual_seed(0)
    cfg = tiny_qwen2_config(48, hidden_size=64, num_layers=2, intermediate_size=96, **kw)
    return transformers.Qwen2ForCausalLM(cfg).float()


# + activation checkpointing (the backward recomputes with the same plan), soft-capping, sliding windows,
# partial rotary, attention sinks (GPT-OSS)
@pytest.mark.parametrize("kind", ["qwen2", "qwen2-checkpointed", "gemma2", "phi3", "gpt_oss"])
def test_log_probs_entropy_and_grads_equal_ungrouped(kind):
    model = _qwen2() if kind.startswith("qwen2") else tiny_model(kind)
    if kind == "qwen2-checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, mask = grpo_rows(model.config.vocab_size)
    _assert_same(model, ids, mask)


def test_flash_convention_kernel_path():
    """The responses' varlen cross attention (cu_seqlens_q != cu_seqlens_k, causal bottom-right) as
    flash-attn runs it, driven on CPU by the reference kernel, equals the SDPA path."""
    model = _qwen2()
    ids, mask = grpo_rows(model.config.vocab_size, seed=1)
    (ref, ref_g) = _run(model, ids, mask, False)
    with va.use_varlen_kernel(va.reference_varlen_attention):
        got, got_g = _run(model, ids, mask, True)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    for name in ref_g:
        assert_grad_close(got_g[name], ref_g[name], name)


def test_lora_and_critic_values():
    from rlhf.models.lora import apply_lora

    model = apply_lora(_qwen2(), lora_rank=4, lora_alpha=8, target_modules="all-linear")
    with torch.no_grad():  # peft starts B at 0: give the adapters a gradient path through A too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids, mask = grpo_rows(48, seed=2)
    _assert_same(model, ids, mask)
    torch.manual_seed(0)
    cfg = tiny_qwen2_config(48, hidden_size=64, num_layers=2, intermediate_size=96)
    cfg.num_labels = 1
    critic = transformers.Qwen2ForTokenClassification(cfg).float().eval()  # eval: no classifier dropout
    _assert_same(critic, ids, mask, fn=packed_forward_values)


def test_worker_passes_with_micro_batch_cuts_and_dynamic_batching(mesh, tmp_path):
    """PolicyWorker log-probs and one SGD update (lr 1: the parameter change is the gradient) with groups
    cut by micro-batch boundaries (3 rows per micro-batch, groups of 4) and by a token budget."""
    from rlhf.models.tiny import write_tiny_model
    from rlhf.schema.batch import RolloutBatch
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    path = write_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=2, intermediate_size=64)
    ids, mask = grpo_rows(40, seed=3)
    N = ids.shape[0]
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, responses=ids[:, P:], response_mask=mask[:, P:].float(),
                         index=torch.arange(N), rollout_log_probs=-torch.rand(N, R, generator=g),
                         truncated=torch.zeros(N, dtype=torch.bool), old_log_probs=-torch.rand(N, R, generator=g),
                         ref_log_probs=-torch.rand(N, R, generator=g), advantages=torch.randn(N, R, generator=g))
    cfg = ActorConfig(lr=1.0, ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=3, grad_clip=1e9, weight_decay=0.0,
                      use_kl_loss=True, entropy_coeff=0.01, ppo_max_token_len_per_gpu=40,
                      log_prob_max_token_len_per_gpu=40)
    workers = [PolicyWorker(ModelConfig(path=str(path), use_remove_padding=True, mixed_precision=False,
                                        prefix_grouping=grouping), mesh, torch.device("cpu"), actor_cfg=cfg)
               for grouping in (False, True)]
    for w in workers:
        w.optimizer = torch.optim.SGD(w.model.parameters(), lr=1.0)
    for dynamic in (False, True):  # the two workers' weights stay equal step after step
        cfg.use_dynamic_bsz = dynamic
        start = [p.full_tensor().clone() for p in workers[0].model.parameters()]
        results = []
        for w in workers:
            lp, _ = w.compute_log_probs(batch, temperature=1.0, micro_batch_size=3)
            w.update_policy(batch, mini_batch_rows=N, temperature=1.0, max_response_length=R)
            results.append((lp, [p.full_tensor().clone() for p in w.model.parameters()]))
        (lp0, p0), (lp1, p1) = results
        torch.testing.assert_close(lp1, lp0, **TOL)
        for a, b, before in zip(p1, p0, start):
            assert_grad_close(a - before, b - before)


def test_auto_rule_and_unsupported_layouts():
    ids, mask = grpo_rows(48)
    saved = shared_prompt_tokens(ids, mask, R)
    assert saved == group_by_prompt(ids, mask, R).saved == 32  # < 64 tokens: auto stays off
    assert not should_group("auto", saved, int(mask.sum()))
    assert should_group(True, 0, 1) and not should_group(False, 9, 9)
    assert should_group("auto", 64, 400) and not should_group("auto", 64, 500)  # >= 64 tokens and >= 15%
    long_ids = torch.cat([torch.randint(3, 48, (1, 20)).expand(ids.shape[0], -1), ids], 1)
    long_mask = torch.cat([torch.ones(ids.shape[0], 20, dtype=torch.long), mask], 1)
    assert shared_prompt_tokens(long_ids, long_mask, R) == 32 + 20 * (ids.shape[0] - 4)
    assert resolve_mode("auto", use_remove_padding=True, sp=2) is False
    assert resolve_mode("auto", use_remove_padding=True) == "auto"
    for kw, word in ((dict(use_remove_padding=False), "use_remove_padding"), (dict(sp=2), "parallel.sp"),
                     (dict(tp=2), "parallel.tp"), (dict(vlm=True), "vision-language"), (dict(moe=True), "MoE")):
        with pytest.raises(ConfigError, match=word):
            resolve_mode(True, **{"use_remove_padding": True, **kw})


def test_auto_rule_by_device_and_model_size():
    """``auto`` on a GPU without flash-attn groups only where an H200 measured it pays (docs/benchmarks.md):
    prompt 1024, response 128, n 8 removes 7168 of ~8960 tokens per micro-batch; bf16 grouped/ungrouped
    was 0.75-0.80x at hidden 1024, 0.83-0.94x at 1536, 1.12-1.23x at 2048. On CPU it paid at every size."""
    saved, total = 7 * 1024, 8 * (1024 + 96)
    for hidden in (64, 1024, 4096):  # CPU: the token rules alone, whatever the model size
        assert should_group("auto", saved, total, device_type="cpu", hidden_size=hidden)
    assert not should_group("auto", saved, total, device_type="cuda", hidden_size=1024)  # host-bound: 0.75x
    assert not should_group("auto", saved, total, device_type="cuda", hidden_size=1536)  # 0.83x
    assert should_group("auto", saved, total, device_type="cuda", hidden_size=2048)  # 1.18x
    assert not should_group("auto", 7 * 256, 8 * (256 + 192), device_type="cuda", hidden_size=3072)  # 0.68x
    assert not should_group("auto", saved, total, device_type="cuda", hidden_size=0)  # size unknown: off
    # with a varlen kernel (flash-attn) the GPU path is unmeasured: the token rules, as on CPU
    assert should_group("auto", saved, total, device_type="cuda", varlen_kernel=True, hidden_size=64)
    # the token rules still come first on a GPU, and true / false are never second-guessed
    assert not should_group("auto", 63, 100, device_type="cuda", hidden_size=1 << 20)
    assert not should_group("auto", 1000, 10000, device_type="cuda", hidden_size=1 << 20)  # 10% < 15%
    assert should_group(True, saved, total, device_type="cuda", hidden_size=64)
    assert not should_group(False, saved, total, device_type="cpu", hidden_size=4096)
    h = 2048  # the threshold is inclusive on saved x hidden^2
    edge = -(-int(AUTO_GPU_MIN_SAVED_WORK) // h ** 2)
    assert should_group("auto", edge, edge, device_type="cuda", hidden_size=h)
    assert not should_group("auto", edge - 1, edge, device_type="cuda", hidden_size=h)


def test_auto_rule_gets_device_and_hidden_size_from_the_pass(monkeypatch):
    """packed.py threads the input's device, the varlen kernel and the model's hidden size into ``auto``."""
    import rlhf.models.packed as packed

    cfg = tiny_qwen2_config(48, hidden_size=32, num_layers=1)
    model = transformers.Qwen2ForCausalLM(cfg)
    ids, mask = grpo_rows(48)
    ids, mask = torch.cat([ids] * 3), torch.cat([mask] * 3)  # >= 64 tokens removed
    seen = []

    def spy(mode, saved, total, **kw):
        seen.append(kw)
        return should_group(mode, saved, total, **kw)

    monkeypatch.setattr(packed, "should_group", spy)
    packed_forward_log_probs(model, ids, mask, response_length=R, prefix_grouping="auto")
    assert seen == [dict(device_type="cpu", varlen_kernel=False, hidden_size=32)]
    assert packed._hidden_size(torch.nn.Linear(2, 2)) == 0


def test_config_key():
    from rlhf.config.load import load_config

    base = ["model.path=m", "data.train_files=t.parquet"]
    for value, want in (("auto", "auto"), ("true", True), ("false", False)):
        cfg = load_config(None, base + ["model.use_remove_padding=true", f"model.prefix_grouping={value}"])
        assert cfg.model.prefix_grouping == want
    assert load_config(None, base).model.prefix_grouping == "auto"
    with pytest.raises(ConfigError, match="model.prefix_grouping"):
        load_config(None, base + ["model.prefix_grouping=yes please"])
    with pytest.raises(ConfigError, match="model.prefix_grouping.*use_remove_padding"):
        load_config(None, base + ["model.prefix_grouping=true"])
