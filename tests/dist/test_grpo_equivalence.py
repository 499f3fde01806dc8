"""Layout invariance of the actor update and exactness of the reshard, on gloo ranks.

One GRPO-style update (PPO-clip + KL loss + entropy bonus, two mini-batches, several
micro-batches) of the same global batch on 1 rank and on 2 ranks must give the same
loss, metrics and updated parameters, for every loss aggregation mode and every policy loss
(the 1-rank run uses 4 micro-batches per mini-batch, each of the 2 ranks 2).
"""

from __future__ import annotations

import os

import pytest
import torch

from rlhf.schema.config import ActorConfig, ModelConfig
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"]
# every policy loss beyond vanilla, with the settings it needs (ratios raised so that
# clip_cov / kl_cov select several tokens of this small batch)
LOSSES = {
    "gspo": {"loss_agg_mode": "seq-mean-token-mean"}, "gpg": {}, "cispo": {"clip_ratio_high": 4.0},
    "dro": {"dro_beta": 0.5}, "dppo_tv": {}, "dppo_kl": {}, "sapo": {"loss_agg_mode": "seq-mean-token-mean"},
    "geo_mean": {"loss_agg_mode": "seq-mean-token-mean"}, "bypass_mode": {}, "clip_cov": {"clip_cov_ratio": 0.05},
    "kl_cov": {"kl_cov_ratio": 0.05},
}
# off-policy corrections (rlhf/train/rollout_corr.py) applied before the update: the batch-normalised
# IS weights and the mismatch metrics are global over ranks, rejection shrinks the masks
CORRECTIONS = {
    "corr:verl": {"rollout_is_decoupled": True, "rollout_is": "token", "rollout_is_batch_normalize": True,
                  "rollout_rs": "token_k1,seq_mean_k1", "rollout_rs_threshold": "0.1_10.0,0.25_4.0",
                  "rollout_token_veto_threshold": 0.06},
    "corr:areal": {"use_decoupled_loss": True, "behav_imp_weight_cap": 5.0},
}
CASES = {**{m: {"loss_agg_mode": m} for m in MODES}, **{f"loss:{k}": {"policy_loss": k, **v} for k, v in LOSSES.items()},
         **CORRECTIONS}
N_PROMPTS, N_SAMPLES, P, R = 8, 4, 6, 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    write_tiny_model(str(d), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return str(d)


def make_global_batch(vocab: int, shared_prompts: bool = False):
    """A deterministic batch of N = 32 rows with uneven response lengths (CPU tensors); ``shared_prompts``:
    the samples of a prompt share its tokens (a GRPO group)."""
    batch = random_rollout_batch(N_PROMPTS, N_SAMPLES, P, R, vocab, holes=True)  # multi-turn masks
    if shared_prompts:
        first = torch.arange(N_PROMPTS).repeat_interleave(N_SAMPLES) * N_SAMPLES
        batch.input_ids[:, :P] = batch.input_ids[first, :P]
        batch.attention_mask[:, :P] = batch.attention_mask[first, :P]
    return batch


def _update_worker(rank: int, world: int, model_dir: str, out: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.train.actor import PolicyWorker
    from rlhf.train.rollout_corr import apply_rollout_correction

    dims = ParallelDims.resolve(-1, 1, 1, world)
    mesh = dims.build_mesh(dist_device_type())
    results = {}
    for mode, over in CASES.items():
        torch.manual_seed(0)
        cfg = ActorConfig(**{**dict(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True,
                                    kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_high=0.28, grad_clip=1e9,
                                    weight_decay=0.0), **over})
        worker = PolicyWorker(ModelConfig(path=model_dir, mixed_precision=False), mesh, dist_device(), actor_cfg=cfg,
                              total_steps=1)
        batch = make_global_batch(worker.hf_config.vocab_size)
        mini_rows = cfg.ppo_mini_batch_size * N_SAMPLES // world
        # Prompts (and their samples) are dealt to ranks mini-batch-major, as the trainer does.
        prompts = minibatch_major_shard(list(range(N_PROMPTS)), rank, world, cfg.ppo_mini_batch_size)
        local = batch.select([p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]).to(dist_device())
        corr = apply_rollout_correction(local, cfg, None) if mode in CORRECTIONS else {}
        metrics = worker.update_policy(local, mini_batch_rows=mini_rows, temperature=1.0, max_response_length=R)
        params = {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
        results[mode] = ({**metrics, **corr}, params)
    if rank == 0:
        torch.save(results, out)


def _features_worker(rank: int, world: int, model_dir: str, out: str, packed: bool, dynamic: bool,
                     grouped: bool = False) -> None:
    """One update with padding-free passes and/or token-budget micro-batches; ``grouped``: the samples
    of a prompt share it and the padding-free passes forward it once (``model.prefix_grouping``)."""
    from rlhf.models.parallel import ParallelDims
    from rlhf.schema.batch import minibatch_major_shard
    from rlhf.train.actor import PolicyWorker

    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh(dist_device_type())
    torch.manual_seed(0)
    # A 20-token budget forces several micro-batches of uneven row counts per rank, and
    # (with 2 ranks) empty micro-batches on the rank whose rows are shorter.
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, weight_decay=0.0,
                      use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=20, log_prob_max_token_len_per_gpu=20)
    worker = PolicyWorker(ModelConfig(path=model_dir, use_remove_padding=packed, mixed_precision=False,
                                      prefix_grouping=grouped and packed), mesh, dist_device(), actor_cfg=cfg,
                          total_steps=1)
    assert worker.prefix_grouping is (grouped and packed)
    batch = make_global_batch(worker.hf_config.vocab_size, shared_prompts=grouped)
    prompts = minibatch_major_shard(list(range(N_PROMPTS)), rank, world, cfg.ppo_mini_batch_size)
    local = batch.select([p * N_SAMPLES + j for p in prompts for j in range(N_SAMPLES)]).to(dist_device())
    log_probs, _ = worker.compute_log_probs(local, temperature=1.0, micro_batch_size=4)
    metrics = worker.update_policy(local, mini_batch_rows=cfg.ppo_mini_batch_size * N_SAMPLES // world,
                                   temperature=1.0, max_response_length=R)
    params = {n: p.full_tensor().cpu().clone() for n, p in worker.model.named_parameters()}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (prompts, (log_probs * local.response_mask).cpu()))
    if rank == 0:
        torch.save((metrics, params, gathered), out)


def _reshard_worker(rank: int, world: int, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from rlhf.models.parallel import ParallelDims
    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.train.actor import PolicyWorker

    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh(dist_device_type())
    worker = PolicyWorker(ModelConfig(path=model_dir, mixed_precision=False), mesh, dist_device(), trainable=False)
    local_numel = sum(p.to_local().numel() for p in worker.model.parameters())
    full_numel = sum(p.numel() for p in worker.model.parameters())
    assert local_numel < full_numel  # really sharded
    weights, stats = gather_rollout_weights(worker.model)
    reference = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    assert set(weights) == set(reference), set(weights) ^ set(reference)
    for name, ref in reference.items():
        assert torch.equal(weights[name].cpu(), ref.detach()), name
    assert stats.bytes_received > 0 and stats.numel == full_numel


def test_update_same_on_1_and_2_ranks(model_dir, tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_distributed(_update_worker, 1, model_dir, one)
    run_distributed(_update_worker, 2, model_dir, two)
    r1, r2 = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    init = {n: p.detach() for n, p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    for mode in CASES:
        m1, p1 = r1[mode]
        m2, p2 = r2[mode]
        assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7), mode
        assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-4), mode
        assert m1["actor/pg_clipfrac"] == pytest.approx(m2["actor/pg_clipfrac"], abs=1e-6), mode
        assert m1["actor/cov_logp_adv"] == pytest.approx(m2["actor/cov_logp_adv"], rel=1e-6), mode
        if "cov" in mode:
            assert m1["actor/cov_selected_frac"] > 0, mode
            assert m1["actor/cov_selected_frac"] == pytest.approx(m2["actor/cov_selected_frac"], abs=1e-9), mode
        moved = 0.0
        for name in p1:
            diff = float((p1[name] - p2[name]).abs().max())
            assert diff < 1e-5, f"{mode} {name}: {diff}"
            moved = max(moved, float((p1[name] - init[name]).abs().max()))
        assert moved > 1e-4, f"{mode}: parameters did not move"
    for mode in CORRECTIONS:  # global figures, and the corrections change the update
        m1, m2 = r1[mode][0], r2[mode][0]
        for key in [k for k in m1 if k.startswith("mismatch/")]:
            assert m1[key] == pytest.approx(m2[key], rel=1e-6, abs=1e-9), (mode, key)  # fp32 sum order
        assert m1["actor/loss"] != pytest.approx(r1["token-mean"][0]["actor/loss"], rel=1e-3), mode
    assert 0.05 < r1["corr:verl"][0]["mismatch/rejected_frac"] < 0.9
    assert r1["corr:verl"][0]["mismatch/is_weight_mean"] == pytest.approx(1.0)  # batch-normalised
    assert r1["corr:areal"][0]["mismatch/is_weight_max"] <= 5.0
    # The modes are really different losses.
    assert r1["token-mean"][0]["actor/loss"] != pytest.approx(r1["seq-mean-token-sum"][0]["actor/loss"])


def test_reshard_round_trip_is_exact(model_dir):
    run_distributed(_reshard_worker, 2, model_dir)


@pytest.mark.parametrize("packed, dynamic, grouped", [(True, False, False), (False, True, False), (True, True, False),
                                                     (True, True, True)])
def test_padding_free_and_dynamic_batches_match_padded(model_dir, tmp_path, packed, dynamic, grouped):
    """Padding-free passes (prefix-grouped or not) and token-budget micro-batches on 2 ranks = padded fixed
    micro-batches on 1."""
    ref, new = str(tmp_path / "ref.pt"), str(tmp_path / "new.pt")
    run_distributed(_features_worker, 1, model_dir, ref, False, False, grouped)
    run_distributed(_features_worker, 2, model_dir, new, packed, dynamic, grouped)
    (m1, p1, g1), (m2, p2, g2) = torch.load(ref, weights_only=False), torch.load(new, weights_only=False)
    lp1 = g1[0][1]
    lp2 = torch.cat([lp for _, lp in g2])
    order = [p for prompts, _ in g2 for p in prompts]
    rows = torch.tensor([p * N_SAMPLES + j for p in order for j in range(N_SAMPLES)])
    torch.testing.assert_close(lp2, lp1[rows], rtol=1e-5, atol=1e-5)
    assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-4)
    for name in p1:
        assert float((p1[name] - p2[name]).abs().max()) < 1e-5, name
