"""HF export and DCP checkpoints of models split into pipeline stages, and LoRA export.

* pp2 (2 gloo ranks): ``export_hf`` of the actor (tied embeddings, 1F1B stage) and of the
  critic (Interleaved1F1B: two stages per rank) reloads with ``from_pretrained`` to
  exactly the parameters of the unsplit model;
* pp2: a DCP checkpoint of the critic (model + AdamW state after one update) loads into a
  freshly built pp2 critic with other weights: same parameters, and the next update is
  identical to the one of the saved worker (so the optimizer state came back too); it
  also resumes into a dp2 critic without pipeline, whose next update matches;
* 1 rank: a LoRA model exports its adapters in PEFT format and the merged model; both
  reload to the training model's logits.
"""

from __future__ import annotations

import torch

from tests.dist._dist_utils import run_distributed

V, H, LAYERS = 64, 32, 4


def _config(**kw):
    import transformers

    return transformers.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **kw)


def _lm(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(_config(tie_word_embeddings=True))


def _critic(seed: int = 0):
    import transformers

    cfg = _config(num_labels=1)
    cfg.classifier_dropout = 0.0
    torch.manual_seed(seed)
    model = transformers.Qwen2ForTokenClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model


def _batch():
    from rlhf.schema.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    n, p, r = 4, 4, 4
    ids = torch.randint(3, V, (n, p + r), generator=g)
    attn = torch.ones(n, p + r, dtype=torch.long)
    attn[0, :2] = 0
    attn[1, -2:] = 0
    ids = ids * attn
    mask = attn[:, p:].float()
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, responses=ids[:, p:], response_mask=mask,
                         index=torch.arange(n), rollout_log_probs=torch.zeros(n, r),
                         truncated=torch.zeros(n, dtype=torch.bool))
    batch.values = torch.zeros(n, r)
    batch.returns = torch.randn(n, r, generator=g) * mask
    return batch


def _critic_worker(mesh, seed: int, schedule: str = "1F1B"):
    from rlhf.schema.config import CriticConfig, ModelConfig, ParallelConfig
    from rlhf.train.critic import CriticWorker

    cfg = CriticConfig(lr=1e-2, weight_decay=0.0, cliprange_value=10.0, ppo_micro_batch_size_per_gpu=2)
    return CriticWorker(cfg, ModelConfig(), mesh, torch.device("cpu"), total_steps=4, max_response_length=4,
                        build_model=lambda: _critic(seed),
                        parallel_cfg=ParallelConfig(pp=2, pp_microbatches=2, pp_schedule=schedule))


def _full_params(worker) -> dict[str, torch.Tensor]:
    from rlhf.rollout.reshard import gather_rollout_weights

    full, _ = gather_rollout_weights(worker.model, pp_group=worker.pp_group)
    return {n: t.clone() for n, t in full.items()}


def _export_worker(rank: int, world: int, out: str) -> None:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.schema.config import ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker
    from rlhf.train.checkpoint import export_hf

    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    actor = PolicyWorker(ModelConfig(), mesh, torch.device("cpu"), trainable=False, build_model=_lm,
                         parallel_cfg=ParallelConfig(pp=2, pp_microbatches=2))
    assert not hasattr(actor.model, "save_pretrained")  # a stage: the export must rebuild the model
    export_hf(actor.model, None, f"{out}/actor")
    critic = _critic_worker(mesh, seed=0, schedule="Interleaved1F1B")
    assert len(critic.pipeline.stages) == 2
    export_hf(critic.model, None, f"{out}/critic")
    if rank != 0:
        return
    for kind, ref, cls in (("actor", _lm(), transformers.AutoModelForCausalLM),
                           ("critic", _critic(), transformers.AutoModelForTokenClassification)):
        loaded = cls.from_pretrained(f"{out}/{kind}")
        assert type(loaded) is type(ref), kind
        got = dict(loaded.named_parameters(remove_duplicate=False))
        want = dict(ref.named_parameters(remove_duplicate=False))
        assert set(got) == set(want), (kind, set(got) ^ set(want))
        for name, p in want.items():
            assert torch.equal(got[name], p), f"{kind} {name}"
    assert loaded.config.num_labels == 1
    tied = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/actor")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_export_under_pp2_equals_unsplit_model(tmp_path):
    run_distributed(_export_worker, 2, str(tmp_path))


def _dcp_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.train.checkpoint import ModelOptimState, load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    batch = _batch()
    saved = _critic_worker(mesh, seed=0)
    saved.update_critic(batch, mini_batch_rows=4)
    path = save_checkpoint(out, 1, {"critic": ModelOptimState(saved.model, saved.optimizer)}, {"global_step": 1})
    resumed = _critic_worker(mesh, seed=1)  # other initial weights, no optimizer state yet
    before = _full_params(resumed)
    state = load_checkpoint(path, {"critic": ModelOptimState(resumed.model, resumed.optimizer)})
    assert state == {"global_step": 1}
    want, got = _full_params(saved), _full_params(resumed)
    assert set(got) == set(want) and "score.weight" in got
    assert any(not torch.equal(before[n], want[n]) for n in want)  # loading really changed the weights
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Same AdamW moments and step count: the next update is identical.
    m_saved = saved.update_critic(batch, mini_batch_rows=4)
    m_resumed = resumed.update_critic(batch, mini_batch_rows=4)
    assert m_saved["critic/vf_loss"] == m_resumed["critic/vf_loss"]
    want, got = _full_params(saved), _full_params(resumed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-7, msg=name)

    # The same checkpoint resumes in another layout (dp2, no pipeline): DCP reshards it.
    from rlhf.schema.config import CriticConfig, ModelConfig
    from rlhf.train.critic import CriticWorker

    dp_mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    cfg = CriticConfig(lr=1e-2, weight_decay=0.0, cliprange_value=10.0, ppo_micro_batch_size_per_gpu=2)
    dp2 = CriticWorker(cfg, ModelConfig(), dp_mesh, torch.device("cpu"), total_steps=4, max_response_length=4,
                       build_model=lambda: _critic(1))
    load_checkpoint(path, {"critic": ModelOptimState(dp2.model, dp2.optimizer)})
    reference = _critic_worker(mesh, seed=1)  # pp2 again, resumed, for the next update
    load_checkpoint(path, {"critic": ModelOptimState(reference.model, reference.optimizer)})
    reference.update_critic(batch, mini_batch_rows=4)
    dp2.update_critic(batch.select([0, 1] if rank == 0 else [2, 3]), mini_batch_rows=2)
    want, got = _full_params(reference), _full_params(dp2)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2e-6, msg=f"dp2 {name}")
    dist.barrier()


def test_dcp_save_load_under_pp2(tmp_path):
    run_distributed(_dcp_worker, 2, str(tmp_path))


def _lora_worker(rank: int, world: int, out: str) -> None:
    import copy
    import json

    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.models.lora import apply_lora, load_adapter
    from rlhf.models.parallelize import parallelize_model
    from rlhf.schema.config import ParallelConfig
    from rlhf.train.checkpoint import export_hf

    model = apply_lora(_lm(), lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # trained-looking adapters (peft starts B at 0, i.e. no change)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    want = copy.deepcopy(model).eval()(input_ids=ids).logits
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    trained = parallelize_model(model, mesh, ParallelConfig(), torch.device("cpu")).module
    export_hf(trained, None, out)

    cfg = json.loads(open(f"{out}/adapter/adapter_config.json").read())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == {"q_proj", "v_proj", "down_proj"}
    adapted = load_adapter(_lm(), f"{out}/adapter").eval()
    torch.testing.assert_close(adapted(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    base = _lm()
    merged_attn, base_attn = merged.model.layers[0].self_attn, base.model.layers[0].self_attn
    assert not torch.allclose(merged_attn.q_proj.weight, base_attn.q_proj.weight)  # adapted: merged in
    assert torch.equal(merged_attn.k_proj.weight, base_attn.k_proj.weight)  # not adapted


def test_lora_export_round_trip(tmp_path):
    run_distributed(_lora_worker, 1, str(tmp_path))
