"""Simulate one rank of a large world in this process: what it holds and sends in one RL step.

    python -m rlhf.simulate --config configs/dapo_qwen2.5_7b_math.yaml --world 64 \\
        model.path=configs/models/Qwen2.5-7B [--rank R] [--gpu h100] [--json]

The real program, not a model of it: the layout checks the launch makes (the same one-line
errors), the real ``DeviceMesh`` on torch's fake process group (``backend="fake"``: collectives
return at once), the actor built by ``rlhf.train.actor.PolicyWorker`` from ``config.json`` alone
(meta device, no weights) with the real TP / FSDP2 / LoRA / activation checkpointing, then parameters and activations as fake tensors (``FakeTensorMode``: shapes and
dtypes only) through one step's phases at the configured shapes:

* ``load``: this rank's parameter shards (and the reference's with ``actor.use_kl_loss``);
* ``rollout``: the reshard to the rollout layout (``rlhf.rollout.reshard.gather_rollout_weights``
  over the ``rollout.tp`` groups), then the sampler's own code (rlhf/ops/sim_rollout.py): the
  engine's ``Sampler`` (fused q|k|v / gate|up weights, the paged KV cache at the engine's budget),
  one admission's prefill at the configured chunking and one decode step with their logits and
  sampling; the value-dependent control (which token, stops, preemption) is left out;
* ``log-probs``: one forward-only micro-batch of the log-prob pass (with pp: one pipelined call);
* ``update``: one training micro-batch (forward, backward, FSDP2 reduce-scatter; with pp: one
  mini-batch's pipelined forward-backward), the grad-norm clip and the AdamW step (its state
  exists from the start, as after the first real step).

Per phase: the peak of live bytes by category (``rlhf/ops/sim_memory.py`` counts storages) and
the bytes each collective type moved. A roofline estimate of each phase's time follows, from
datasheet FLOP/s and link bandwidths (``rlhf/ops/hardware.py``), labelled as an estimate.

Pipeline parallelism (``parallel.pp > 1``): without ``--rank``, one rank of every stage, each in
its own process; a stage runs what its schedule would run on it (the receive buffers, the
1F1B / GPipe order, FSDP2's no-sync backwards, the stage-boundary sends; rlhf/ops/sim_pipeline.py)
and the reshard's stage exchange gets every peer stage's tensors. Padding-free and Ulysses
(``parallel.sp``) passes pack full-length rows up to the token budget and run the real packed
forward, the token layout computed on the host (rlhf/ops/sim_packed.py), attention with
flash-attn's allocations, the all-to-alls counted. Mixture-of-experts models run with their experts
over ``parallel.ep``, the dispatch sized under balanced routing (rlhf/ops/sim_moe.py); with
``model.param_offload`` the training state is counted as host memory, outside the device totals.

The simulated device is the run's (``--device cuda``, the default, keeps FSDP2's bf16 mixed
precision as on a GPU). Not simulated, and said so in the output: the critic and trainer.mode
one_step_off / fully_async roles (simulated as the colocated layout).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlhf.schema.config import Config, ConfigError

if TYPE_CHECKING:
    from rlhf.models.parallel import ParallelDims

GIB = 1024 ** 3


@dataclass
class Simulation:
    """What one simulated rank held and sent, per phase."""

    layout: dict
    peaks: dict[str, dict[str, int]]  # phase -> {category: bytes at the phase's peak, "total"}
    comm: dict[str, dict[str, int]]  # phase -> {collective: bytes}
    comm_cross: dict[str, dict[str, int]]  # phase -> {collective: bytes over groups that span nodes}
    calls: dict[str, dict[str, int]]  # phase -> {collective: count}
    flops: dict[str, float]  # phase -> model FLOPs of this rank
    roofline: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=lambda p: self.peaks[p]["total"])

    def to_json(self) -> dict:
        return {"layout": self.layout, "peaks": self.peaks, "comm": self.comm, "comm_cross": self.comm_cross,
                "calls": self.calls,
                "flops": self.flops, "roofline": self.roofline, "notes": self.notes, "peak_phase": self.peak_phase}


def check_launch(cfg: Config, hf_config, world: int) -> ParallelDims:
    """The layout checks of ``RLTrainer.__init__``, in its order, with its messages."""
    from rlhf.models.parallel import ParallelDims
    from rlhf.models.parallelize import validate_layout

    dims = ParallelDims.resolve(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, world, sp=cfg.parallel.sp,
                                ep=cfg.parallel.ep)
    dims.check_batch(train_batch_size=cfg.data.train_batch_size, n=cfg.rollout.n,
                     mini_batch_size=cfg.actor.ppo_mini_batch_size)
    validate_layout(cfg.parallel, hf_config, world, rollout_tp=cfg.rollout.tp,
                    train_batch_size=cfg.data.train_batch_size, mini_batch_size=cfg.actor.ppo_mini_batch_size,
                    n=cfg.rollout.n, use_remove_padding=cfg.model.use_remove_padding)
    return dims


@contextmanager
def _mixed_precision_as_on(device: str):
    """FSDP2 mixed precision is chosen from the device type; the simulated ranks build on meta."""
    from rlhf.models import fsdp

    saved = set(fsdp.MIXED_PRECISION_DEVICES)
    if device in saved:
        fsdp.MIXED_PRECISION_DEVICES.add("meta")
    try:
        yield
    finally:
        fsdp.MIXED_PRECISION_DEVICES.clear()
        fsdp.MIXED_PRECISION_DEVICES.update(saved)


def _meta_builder(hf_config, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM

    def build():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn)
        model.config.use_cache = False
        return model
    return build


def simulate(cfg: Config, *, world: int, rank: int = 0, device: str = "cuda", flash_attn: bool = True) -> Simulation:
    """Run one rank (``rank``) of a ``world``-rank job of ``cfg`` on a fake process group (``flash_attn``: the
    simulated GPU has flash-attn installed; its sampler decodes with flash-attn's paged kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlhf.models.loading import DTYPES, language_config, model_config, training_attn_implementation
    from rlhf.ops.sim_memory import HOST, LiveBytes, fsdp_offload_on_host, fsdp_storage_resizes
    from rlhf.ops.sim_moe import moe_on_host
    from rlhf.ops.sim_packed import flash_attention_shapes, packed_layout_on_host
    from rlhf.ops.sim_rollout import decoder_weight_bytes, simulate_sampler
    from rlhf.rollout.engine import rollout_dtype
    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights
    from rlhf.train.actor import PolicyWorker

    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not a rank of --world {world}")
    full = model_config(cfg.model.path, cfg.model.trust_remote_code)
    hf = language_config(full)  # a vision-language model's language model sizes the layout and the passes
    dims = check_launch(cfg, hf, world)
    notes: list[str] = []
    held: list = []  # tensors that live to the end of the simulated step
    if cfg.trainer.mode != "colocated":
        notes.append(f"trainer.mode {cfg.trainer.mode}: simulated as the colocated layout on the whole world")
    if cfg.algorithm.adv_estimator == "gae":
        notes.append("the critic (adv_estimator gae) is not simulated")
    if cfg.model.use_remove_padding:
        notes.append("padding-free micro-batches: full-length rows packed up to the token budget")
    if cfg.rollout.speculative.enable:
        notes.append("rollout.speculative: the sampler's plain decode step is simulated, not the draft verification")
    # grouping prompts reads their token values (fake tensors have none); it only lowers the real peak
    cfg.model.prefix_grouping = False
    if dist.is_initialized():
        raise RuntimeError("rlhf.simulate needs a process without a process group")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = dims.build_mesh("cpu")  # the fake group's tensors live on the host whatever the run's device
        # SDPA as the trainer loads it: the project's varlen attention where HF has no SDPA path (Gemma 2's
        # soft-cap, GPT-OSS's sinks)
        build = _meta_builder(full, DTYPES[cfg.model.dtype], training_attn_implementation(full, "sdpa"))
        meta = torch.device("meta")
        with _mixed_precision_as_on(device):
            actor = PolicyWorker(cfg.model, mesh, meta, trainable=True, actor_cfg=cfg.actor, total_steps=1,
                                 build_model=build, parallel_cfg=cfg.parallel)
            need_ref = (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and cfg.model.lora_rank == 0
            ref = PolicyWorker(cfg.model, mesh, meta, trainable=False, parallel_cfg=cfg.parallel, lora=False,
                               build_model=build) if need_ref else None
            teachers = _teachers(cfg, mesh, meta, PolicyWorker)
        if teachers:
            notes.append("distill.teachers: their parameters are counted; their log-prob passes are not simulated")
        layout = RolloutLayout.build(cfg.rollout.tp, device)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        counter = LiveBytes(ranks_per_node=8)
        hidden_dtype = torch.bfloat16 if device == "cuda" and cfg.model.mixed_precision else DTYPES[cfg.model.dtype]
        # with model.param_offload the training state (parameters, gradients, AdamW) is host memory
        state = dict.fromkeys(("parameters", "gradients", "optimizer"), HOST) if cfg.model.param_offload else {}
        if state:
            notes.append("model.param_offload: parameters, gradients and optimizer state counted as host memory, "
                         "outside the totals (the device's copy of a shard before its all-gather is not)")
        ctx = _Ctx(cfg, hf, dims, actor, counter, hidden_dtype, state)
        with fake, packed_layout_on_host(), moe_on_host(), flash_attention_shapes(), \
                fsdp_storage_resizes(counter), fsdp_offload_on_host(counter):
            for w in (actor, ref, *teachers):
                if w is not None:
                    w.model.to_empty(device="cpu")
            with counter:
                counter.adopt(actor.model.parameters(), state.get("parameters", "parameters"))
                if ref is not None:
                    counter.adopt(ref.model.parameters(), state.get("parameters", "parameters"))
                for t in teachers:
                    counter.adopt(t.model.parameters(), HOST if t.cfg.param_offload else "parameters")
                _warm_optimizer(actor, counter, state.get("optimizer", "optimizer"))
                counter.phase("rollout")
                rdt = rollout_dtype(cfg.rollout.dtype, device, cfg.model.dtype)
                with counter.category("rollout weights"), _stage_exchange(actor, build, layout, rdt):
                    weights, _ = gather_rollout_weights(actor.model, dtype=rdt, pp_group=actor.pp_group,
                                                        tp_rank=layout.tp_rank, tp_size=layout.tp,
                                                        tp_group=layout.tp_group,
                                                        quantization=cfg.rollout.quantization or None,
                                                        quantization_scale=cfg.rollout.quantization_scale)
                sampler = simulate_sampler(cfg, hf, weights, layout, rdt, counter, world=world, device=device,
                                           flash_attn=flash_attn)
                decode_reads = decoder_weight_bytes(sampler.weights)
                if (device == "cuda" and cfg.rollout.compile) or not cfg.rollout.free_cache_engine:
                    held.append(sampler)  # the run-long sampler (CUDA graphs, or free_cache_engine=False)
                    notes.append("the sampler (rollout.compile on cuda or free_cache_engine=False) keeps its weights "
                                 "and KV cache through the training phases (a CUDA-graph pool is not simulated)")
                del weights, sampler
                counter.phase("log-probs")
                with unset_fake_temporarily():  # real token ids: a packed pass reads its layout off them
                    lp_ids, lp_mask = ctx.batch(ctx.log_prob_rows())
                ctx.log_prob_pass(lp_ids, lp_mask)
                counter.phase("update")
                with unset_fake_temporarily():
                    ids, mask = ctx.batch(ctx.update_rows())
                ctx.update(ids, mask)
        lp_tokens, tokens = int(lp_mask.sum()), int(mask.sum())  # real (host) masks
        flops = ctx.flops(lp_tokens, tokens)
        lay = {"world": world, "rank": rank, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "sp": dims.sp,
               "ep": dims.ep, "pp_stage": actor.pipeline.pp_rank if actor.pipeline is not None else 0,
               "rollout_tp": layout.tp, "device": device, "lp_rows": lp_ids.shape[0], "update_rows": ids.shape[0],
               "lp_tokens": lp_tokens, "update_tokens": tokens, "decode_weight_bytes": decode_reads,
               "seq_len": ids.shape[1], "packed": cfg.model.use_remove_padding,
               "model": hf.architectures[0] if getattr(hf, "architectures", None) else hf.model_type}
        peaks = {k: v for k, v in counter.peaks.items() if k != "start"}
        return Simulation(layout=lay, peaks=peaks, comm={k: dict(v) for k, v in counter.comm.items() if k != "start"},
                          comm_cross={k: dict(v) for k, v in counter.comm_cross.items() if k != "start"},
                          calls={k: dict(v) for k, v in counter.calls.items() if k != "start"}, flops=flops,
                          notes=notes)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _teachers(cfg: Config, mesh, meta, worker_cls) -> list:
    """The ``distill.teachers`` as the trainer builds them (rlhf/train/distill.py), from config.json alone."""
    import dataclasses

    from rlhf.models.loading import DTYPES, model_config, training_attn_implementation

    out = []
    for t in (cfg.distill.teachers.values() if cfg.distill.enabled else ()):
        full = model_config(t.path, cfg.model.trust_remote_code)
        model_cfg = dataclasses.replace(cfg.model, path=t.path, dtype=t.dtype or cfg.model.dtype,
                                        param_offload=t.param_offload, lora_rank=0)
        build = _meta_builder(full, DTYPES[model_cfg.dtype], training_attn_implementation(full, "sdpa"))
        out.append(worker_cls(model_cfg, mesh, meta, trainable=False, parallel_cfg=cfg.parallel, lora=False,
                              build_model=build))
    return out


def _forget_meshes() -> None:
    """DTensor caches sharding decisions keyed by meshes that compare equal across process groups; a
    later simulation in this process (another pipeline stage) must not get this one's destroyed groups."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    prop = DTensor._op_dispatcher.sharding_propagator
    for fn in (prop.propagate_op_sharding, getattr(prop, "_propagate_tensor_meta_cached", None)):
        clear = getattr(getattr(fn, "cache", fn), "cache_clear", None)
        if clear is not None:
            clear()
    _gen_transform_infos.cache_clear()


@contextmanager
def _stage_exchange(actor, build, layout, dtype):
    """Under pp, the reshard's stage exchange gets every peer stage's tensor list (rlhf/ops/sim_pipeline.py)."""
    from rlhf.ops.sim_pipeline import peer_stage_tensors, stage_exchange_from

    p = actor.pipeline
    if p is None:
        yield
        return
    do_slice = layout.tp == 1 or len({r % layout.tp for r in dist.get_process_group_ranks(actor.pp_group)}) == 1
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        peers = peer_stage_tensors(build(), p.pp, p.virtual_stages, dtype=dtype, tp_rank=layout.tp_rank,
                                   tp_size=layout.tp, do_slice=do_slice)
    with stage_exchange_from(peers):
        yield


class _Ctx:
    """The log-prob and update micro-batches of one simulated rank, as the trainer sizes them."""

    def __init__(self, cfg: Config, hf, dims, actor, counter, hidden_dtype: torch.dtype, state: dict) -> None:
        self.cfg, self.hf, self.dims, self.actor, self.counter = cfg, hf, dims, actor, counter
        self.hidden_dtype, self.state = hidden_dtype, state  # state: category -> where it is counted (offload)
        d = cfg.data
        self.R = d.max_response_length
        self.L = d.max_prompt_length + d.max_response_length
        # rows this dp rank holds in a step and in a mini-batch
        self.local_rows = max(1, d.train_batch_size * cfg.rollout.n // dims.dp)
        self.mini_rows = max(1, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // dims.dp)

    def _rows(self, budget: int, micro: int, cap: int) -> tuple[int, int]:
        """Rows of one micro-batch and the real tokens of its last row. Under ``use_dynamic_bsz`` a
        packed micro-batch is filled to its token budget (times sp: verl's per-GPU budget is one sp
        group's): full-length rows and one shorter last row, as variable-length data can fill it;
        padded rows cost their full length, so only whole ones fit. Never more than the ``cap`` rows
        the pass splits (the rank's rows, or a mini-batch's: ``split_rows`` cuts no larger micro-batch)."""
        a, pp = self.cfg.actor, self.actor.pipeline
        if pp is not None:  # pipelined calls of micro x pp_microbatches rows
            return (min(self.local_rows, micro * pp.n_microbatches) if micro else self.local_rows), self.L
        if not a.use_dynamic_bsz:
            return max(1, min(micro, cap)), self.L
        tokens = budget * self.dims.sp
        full, rest = divmod(tokens, self.L)
        if full >= cap:
            return cap, self.L
        if self.cfg.model.use_remove_padding and rest > self.cfg.data.max_prompt_length:
            return full + 1, rest
        return max(1, full), self.L

    def log_prob_rows(self) -> tuple[int, int]:
        a = self.cfg.actor
        return self._rows(a.log_prob_max_token_len_per_gpu, a.log_prob_micro_batch_size_per_gpu, self.local_rows)

    def update_rows(self) -> tuple[int, int]:
        a = self.cfg.actor
        if self.actor.pipeline is not None:  # one pipelined forward-backward per mini-batch
            return self.mini_rows, self.L
        return self._rows(a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu, self.mini_rows)

    def batch(self, rows_last: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, last = rows_last
        if self.actor.pipeline is not None:
            rows += (-rows) % self.actor.pipeline.n_microbatches
        mask = torch.ones(rows, self.L, dtype=torch.long)
        mask[-1, last:] = 0  # a shorter last row: its response ends early (right padding)
        return torch.randint(0, self.hf.vocab_size, (rows, self.L)), mask

    def _runner(self):
        from rlhf.ops.sim_pipeline import StageRunner

        p, hf = self.actor.pipeline, self.hf
        tied = hf.vocab_size * hf.hidden_size // (self.dims.tp * self.dims.dp * self.dims.sp)
        return StageRunner(p, hf.hidden_size, self.hidden_dtype, counter=self.counter, tied_numel=tied)

    def log_prob_pass(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        # the trainer's old-log-prob pass always computes the entropy (a logged metric)
        temp = self.cfg.rollout.temperature or 1.0
        with torch.no_grad():
            self.actor.model.eval()
            if self.actor.pipeline is not None:
                self.actor._pp_mode(temp, True)
                out = self._runner().forward(ids, mask)
            else:
                out = self.actor.forward_log_probs(ids, mask, response_length=self.R, temperature=temp,
                                                   compute_entropy=True)
        del out

    def update(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        from rlhf.models.parallelize import clip_grad_norm_

        a, actor, R = self.cfg.actor, self.actor, self.R
        temp = self.cfg.rollout.temperature or 1.0
        entropy = a.entropy_coeff != 0
        actor.model.train()

        def loss_of(lp, ent):
            # the policy loss' elementwise terms are [rows, R]: negligible next to the logits
            loss = -(lp * torch.ones_like(lp)).mean() * actor.grad_scale
            return loss - a.entropy_coeff * ent.mean() if ent is not None else loss

        if actor.pipeline is not None:
            actor._pp_mode(temp, entropy)
            self._runner().forward_backward(ids, mask, lambda y: loss_of(y[..., 0][:, -R:], y[..., 1][:, -R:])
                                            if entropy else loss_of(y[:, -R:], None))
        else:
            if ids.shape[0] < self.mini_rows and not self.cfg.model.unsharded_grad_accumulation:
                # not the mini-batch's first micro-batch at its peak: the earlier ones' sharded gradients
                # are held through this forward and backward (FSDP2 adds the new reduce-scatter into them)
                with self.counter.category(self.state.get("gradients", "gradients")):
                    for p in actor.model.parameters():
                        if p.requires_grad:
                            p.grad = torch.zeros_like(p)
            lp, ent = actor.forward_log_probs(ids, mask, response_length=R, temperature=temp,
                                              compute_entropy=entropy)
            loss_of(lp, ent).backward()
            del lp, ent
        params = list(actor.model.parameters())
        self.counter.relabel([p.grad for p in params if p.grad is not None], self.state.get("gradients", "gradients"))
        with self.counter.category(self.state.get("optimizer", "optimizer")):
            clip_grad_norm_(params, a.grad_clip or 1e9, stage_ranks=actor.stage_ranks, group=actor.mesh_group)
            actor.optimizer.step()
        actor.optimizer.zero_grad(set_to_none=True)

    def flops(self, lp_tokens: int, tokens: int) -> dict[str, float]:
        from rlhf.ops.flops import model_flops_per_token

        share = 1.0 / (self.dims.tp * self.dims.pp * self.dims.sp)  # sp ranks split a micro-batch's tokens
        ckpt = 4 / 3 if self.cfg.model.enable_gradient_checkpointing else 1
        return {"log-probs": model_flops_per_token(self.hf, self.L, False) * lp_tokens * share,
                "update": model_flops_per_token(self.hf, self.L, True) * tokens * share * ckpt}


def _warm_optimizer(worker, counter, cat: str = "optimizer") -> None:
    """AdamW's state as after the first step (it is made lazily, and lives through every later phase)."""
    params = [p for p in worker.model.parameters() if p.requires_grad]
    with counter.category(cat):
        for p in params:
            p.grad = torch.zeros_like(p)
        worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    states = [t for st in worker.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    counter.relabel(states, cat)


# --------------------------------------------------------------------------- roofline


def roofline(sim: Simulation, cfg: Config, hf, *, gpu: str = "h100") -> dict[str, dict[str, float]]:
    """An estimate, not a measurement: each phase's time as the larger of its compute at the GPU's
    dense bf16 peak and its collective bytes over the link each group uses (NVLink for groups inside
    one 8-GPU node, InfiniBand NDR for groups that span nodes), overlap assumed perfect; the rollout
    as memory-bound decode (every step reads the rollout weights and the live KV cache at HBM speed)."""
    from rlhf.ops.hardware import GPUS, LINKS

    spec = GPUS[gpu]
    node, net = LINKS["nvlink4" if gpu != "a100" else "nvlink3"], LINKS["ib-ndr"]
    out: dict[str, dict[str, float]] = {}
    for ph in sim.peaks:
        cross = sum(sim.comm_cross.get(ph, {}).values())
        comm_s = (sum(sim.comm.get(ph, {}).values()) - cross) / node.bandwidth + cross / net.bandwidth
        compute_s = sim.flops.get(ph, 0.0) / spec.bf16
        out[ph] = {"compute_s": compute_s, "comm_s": comm_s, "estimate_s": max(compute_s, comm_s)}
    if "rollout" in out:
        # the sampler's weights a decode step reads (under pp the exchange's buffers are held too, unread)
        rw = sim.layout.get("decode_weight_bytes", sim.peaks["rollout"]["rollout weights"])
        kv = sim.peaks["rollout"]["kv cache"]
        decode = cfg.data.max_response_length * (rw + kv / 2) / spec.hbm  # the cache is half full on average
        out["rollout"]["decode_s"] = decode
        out["rollout"]["estimate_s"] = max(out["rollout"]["estimate_s"], decode)
    out["_hardware"] = {"gpu": spec.name, "bf16_flops": spec.bf16, "hbm_bytes_s": spec.hbm,
                        "link": f"{node.name} inside a node of 8, {net.name} across nodes"}
    return out


def format_simulation(sim: Simulation) -> str:
    lay = sim.layout
    extra = "".join(f" x {k} {lay[k]}" for k in ("sp", "ep") if lay.get(k, 1) > 1)
    stage = f" (stage {lay['pp_stage']})" if lay["pp"] > 1 else ""
    lines = [f"[sim] {lay['model']}: rank {lay['rank']}{stage} of world {lay['world']} = dp {lay['dp']} x tp "
             f"{lay['tp']} x pp {lay['pp']}{extra}, rollout.tp {lay['rollout_tp']}, device {lay['device']} (fake "
             f"process group, fake tensors)", "[sim] peak memory per phase, by category (GiB):"]
    for ph, d in sim.peaks.items():
        parts = ", ".join(f"{k} {v / GIB:.3f}" for k, v in d.items() if k != "total" and v)
        mark = "  <- peak" if ph == sim.peak_phase else ""
        lines.append(f"[sim]   {ph:10s}{d['total'] / GIB:8.3f}{mark}   ({parts})")
    lines.append("[sim] bytes per collective (this rank, per phase):")
    for ph, d in sim.comm.items():
        parts = ", ".join(f"{k} {v / GIB:.3f} GiB in {sim.calls[ph][k]} calls"
                          + (f" ({sim.comm_cross[ph][k] / GIB:.3f} across nodes)" if sim.comm_cross[ph].get(k) else "")
                          for k, v in sorted(d.items()))
        lines.append(f"[sim]   {ph:10s}{parts or 'none'}")
    if sim.roofline:
        hw = sim.roofline["_hardware"]
        lines.append(f"[sim] ESTIMATE (roofline, not a measurement) on {hw['gpu']} ({hw['bf16_flops'] / 1e12:.0f} "
                     f"TFLOP/s bf16, {hw['hbm_bytes_s'] / 1e12:.2f} TB/s HBM), collectives over {hw['link']}:")
        for ph, d in sim.roofline.items():
            if ph != "_hardware":
                extra = f", decode {d['decode_s']:.1f} s" if "decode_s" in d else ""
                unit = "for one generation wave of the slots (decode-bound)" if ph == "rollout" else \
                    "per pipelined call" if lay["pp"] > 1 else "per micro-batch"
                lines.append(f"[sim]   {ph:10s}~{d['estimate_s']:.3f} s {unit} (compute {d['compute_s']:.3f} "
                             f"s, collectives {d['comm_s']:.3f} s{extra})")
    lines += [f"[sim] note: {n}" for n in sim.notes]
    return "\n".join(lines)


def stage_ranks(pp: int, world: int) -> list[int]:
    """One rank of every pipeline stage: the mesh is (pp, dp, sp, tp), pp outermost."""
    return [s * (world // pp) for s in range(pp)]


def _in_children(argv: list[str], ranks: list[int]) -> list[Simulation]:
    """Each rank's simulation in a fresh process, all at once (DTensor keeps caches that a second
    fake group in one process would trip on; the stages are independent)."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", "rlhf.simulate", *argv, "--rank", str(r), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ranks]
    sims = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            sys.stderr.write(err)
            sys.exit(p.returncode)
        data = json.loads(out.strip().splitlines()[-1])
        data.pop("peak_phase")
        sims.append(Simulation(**data))
    return sims


def simulate_stages(cfg: Config, *, world: int, device: str = "cuda", gpu: str = "h100",
                    flash_attn: bool = True) -> list[Simulation]:
    """Rank 0 with its roofline, or with ``parallel.pp > 1`` one rank of every stage, each in its own
    process (``cfg`` handed to them as a yaml file), all at once."""
    import os
    import tempfile

    from rlhf.models.loading import language_config, model_config

    hf = language_config(model_config(cfg.model.path, cfg.model.trust_remote_code))
    if cfg.parallel.pp == 1:
        sim = simulate(cfg, world=world, rank=0, device=device, flash_attn=flash_attn)
        sim.roofline = roofline(sim, cfg, hf, gpu=gpu)
        return [sim]
    check_launch(cfg, hf, world)  # the launch's error here, once, not once per stage
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.yaml")
        with open(path, "w") as f:
            f.write(cfg.to_yaml())
        flash = [] if flash_attn else ["--no-flash-attn"]
        return _in_children(["--config", path, "--world", str(world), "--device", device, "--gpu", gpu, *flash],
                            stage_ranks(cfg.parallel.pp, world))


def main(argv=None) -> None:
    from rlhf.config.load import load_config
    from rlhf.models.loading import language_config, model_config

    ap = argparse.ArgumentParser(description="Run one rank of a large world on a fake process group "
                                             "(fake tensors) and report its memory and collectives.")
    ap.add_argument("--config", help="yaml config file")
    ap.add_argument("--world", type=int, default=8, help="ranks of the simulated job (default 8)")
    ap.add_argument("--rank", type=int, default=None,
                    help="the rank to simulate (default: rank 0; with parallel.pp > 1 one rank of every stage, "
                         "in parallel processes)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the run's device (mixed precision)")
    ap.add_argument("--gpu", choices=("h100", "h200", "a100"), default="h100", help="roofline hardware")
    ap.add_argument("--no-flash-attn", action="store_true",
                    help="the GPU has no flash-attn: the sampler decodes with the gather kernel (its block size, "
                         "its buffers)")
    ap.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.rank is None:  # every distinct pipeline stage
            sims = simulate_stages(cfg, world=args.world, device=args.device, gpu=args.gpu,
                                   flash_attn=not args.no_flash_attn)
        else:
            sims = [simulate(cfg, world=args.world, rank=args.rank, device=args.device,
                             flash_attn=not args.no_flash_attn)]
            hf = language_config(model_config(cfg.model.path, cfg.model.trust_remote_code))
            sims[0].roofline = roofline(sims[0], cfg, hf, gpu=args.gpu)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(format_simulation(sim) for sim in sims))
    if args.json:
        for sim in sims:
            print(json.dumps(sim.to_json()))


if __name__ == "__main__":
    main()
