"""The policy (actor) and the frozen reference: HF models in the training layout and their passes.

`PolicyWorker` owns a model in the training layout of the ("pp", "dp", "tp") mesh (built
by :func:`rlhf.models.parallelize.parallelize_model`: pipeline stages on pp, tensor
parallel on tp, FSDP2 on dp) and, when trainable, its optimizer and LR schedule. Its two
passes are the two the RL loop needs: forward-only log-probs over micro-batches, and the
PPO-style update over mini-batches with gradient accumulation.

Every loss is normalised by *global* token/sequence counts of the mini-batch (all-reduced
over dp) and multiplied by ``grad_scale`` (FSDP2 averages over dp; we need the sum), so
the update does not depend on the dp size or the number of micro-batches. Under TP the
log-probs come from vocab-sharded logits (``rlhf.models.vocab_parallel``, no full-vocab
gather); under PP one pipelined forward-backward per mini-batch (``parallel.pp_microbatches``
micro-batches) replaces the micro-batch loop, and the loss is computed on the last stage.
The gradient norm is global over all pp x dp x tp ranks.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rlhf.algos.aggregation import AggNorm, agg_loss
from rlhf.algos.entropy_tools import covariance_from_sums, covariance_sums, entropy_coeff_at
from rlhf.algos.kl import kl_penalty
from rlhf.algos.optimal_token_baseline import sum_pi_squared_from_logits
from rlhf.algos.policy_loss import PolicyLossParams, get_policy_loss
from rlhf.algos.policy_loss_cov import COV_LOSSES, select_cov_tokens
from rlhf.data.batching import micro_batches_for_rank
from rlhf.data.multimodal import collate_multi_modal
from rlhf.models import batch_invariant as invariant
from rlhf.models.fp8_training import apply_fp8_training
from rlhf.models.fsdp import grad_scale, keep_unsharded
from rlhf.models.loading import load_causal_lm, vision_tower
from rlhf.models.logprobs import position_ids_from_mask, token_log_probs
from rlhf.models.lora import apply_lora
from rlhf.models.mrope import is_vlm_config
from rlhf.models.moe import MoESpec
from rlhf.models.moe_archs import is_moe
from rlhf.models.moe_stats import RouterStats
from rlhf.models.packed import packed_forward_log_probs
from rlhf.models.prefix_grouping import resolve_mode
from rlhf.models.parallel import all_reduce_sum, fsdp_mesh, mesh_group, sp_group
from rlhf.models.parallelize import ParallelModel, clip_grad_norm_, parallelize_model
from rlhf.models.router_replay import RouterReplay, build_router_replay
from rlhf.models.ulysses import check_sp
from rlhf.models.vlm import dummy_image_forward, padded_inputs
from rlhf.models.vocab_parallel import log_probs_from_logits
from rlhf.schema.batch import RolloutBatch, split_rows
from rlhf.schema.config import ActorConfig, ConfigError, ModelConfig, ParallelConfig
from rlhf.train.grad_free import grad_free_rows, reduce_with_splits, skips_grad_free_rows, split_mini_step
from rlhf.train.metric_sums import MetricSums
from rlhf.train.optim import NonFiniteGuard, build_optimizer, build_scheduler


def run_ppo_epochs(worker, batch: RolloutBatch, *, mini_batch_rows: int, epochs: int, shuffle: bool,
                   max_response_len: int, grad_clip: float, prefix: str, loss_name: str,
                   mini_step: Callable[..., torch.Tensor],
                   row_split: Optional[Callable[[RolloutBatch], torch.Tensor]] = None) -> dict[str, float]:
    """The update loop shared by the actor and the critic: `epochs` passes over mini-batches of
    `mini_batch_rows` local rows, one clipped optimizer step per mini-batch.

    `mini_step(mini, norm, metrics)` accumulates gradients and returns this rank's loss sum;
    `norm` holds the mini-batch's token and sequence counts over all dp ranks (sequences
    without a response token do not count, as in agg_loss with norm=None). Steps whose loss
    or global grad norm is not finite are skipped by the worker's NonFiniteGuard. Returns
    metrics reduced over dp (and taken from the last pipeline stage, which computes the loss).
    `row_split(mini)` ([rows] bool, rows without a gradient; rlhf/train/grad_free.py) adds a
    ``split=RowSplit`` argument to `mini_step`, from the same all-reduce and host read.
    """
    metrics = MetricSums.new(worker.device)
    params = [p for p in worker.model.parameters() if p.requires_grad]
    norm_params = [p for p in worker.parallel.norm_parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1234)
    n_rows = len(batch)
    # A whole-model FSDP2 unit keeps its forward all-gather for the backward (no pipeline schedule here).
    whole = worker.pipeline is None and worker.parallel.fsdp_unit == "model"
    with keep_unsharded(worker.parallel.module, whole):
        for _ in range(epochs):
            order = torch.randperm(n_rows, generator=gen) if shuffle else torch.arange(n_rows)
            minis = [batch.select(order[rows]) for rows in split_rows(n_rows, mini_batch_rows)]
            # Every mini-batch's global counts: one all-reduce and one host read per epoch.
            counts = torch.stack([torch.stack([m.response_mask.sum(), (m.response_mask.sum(-1) > 0).sum()]).double()
                                  for m in minis]) if minis else torch.zeros(0, 2, dtype=torch.float64)
            if row_split is None:
                counts, splits = all_reduce_sum(counts.to(worker.device), worker.dp_group).tolist(), [{}] * len(minis)
            else:
                counts, splits = reduce_with_splits(counts, [row_split(m) for m in minis], worker.dp_group, worker.device)
                splits = [{"split": s} for s in splits]
            for mini, (tokens, seqs), split in zip(minis, counts, splits):
                norm = AggNorm(global_tokens=tokens, global_seqs=seqs, max_response_len=max_response_len)
                worker.optimizer.zero_grad(set_to_none=True)
                step_loss = mini_step(mini, norm, metrics, **split)
                all_reduce_sum(step_loss, worker.dp_group)
                grad_norm = clip_grad_norm_(params, grad_clip, stage_ranks=worker.stage_ranks, norm_params=norm_params,
                                            device=worker.device, group=worker.mesh_group)
                # The one host read per mini-batch: whether the step may be taken.
                loss_value, norm_value = torch.stack([step_loss.double(), grad_norm.double()]).tolist()
                if worker.nonfinite.ok(loss_value, norm_value, worker.optimizer):
                    worker.optimizer.step()
                    metrics.add(f"{prefix}/{loss_name}", loss_value)
                    metrics.add(f"{prefix}/grad_norm", norm_value)
    worker.optimizer.zero_grad(set_to_none=True)
    out = metrics.reduce(worker.dp_group)
    if worker.pipeline is not None:
        box = [out]
        dist.broadcast_object_list(box, src=dist.get_global_rank(worker.pp_group, worker.pipeline.pp - 1),
                                   group=worker.pp_group)
        out = box[0]
    out[f"{prefix}/lr"] = worker.optimizer.param_groups[0]["lr"]
    out[f"{prefix}/skipped_nonfinite_steps"] = float(worker.nonfinite.skipped)
    worker.scheduler.step()
    return out


def adopt_layout(worker, parallel: ParallelModel, mesh: DeviceMesh) -> None:
    """Attributes every training worker (actor, reference, critic) derives from its layout."""
    worker.model = parallel.module
    worker.pipeline = parallel.pipeline
    worker.pp_group = parallel.pp_group
    worker.stage_ranks = fsdp_mesh(mesh).size() * mesh["tp"].size()  # ranks holding one pp stage
    worker.mesh_group = mesh_group(mesh)  # the grad norm sums over every rank of the mesh
    # FSDP2 averages over dp x sp; sp ranks hold disjoint parts of the same loss' gradient.
    worker.grad_scale = grad_scale(fsdp_mesh(mesh))
    worker.sp_group = sp_group(mesh)


def check_features(model_cfg: ModelConfig, mesh: DeviceMesh, lora: bool, hf_config=None) -> None:
    """Feature combinations this version does not support, named before any work is done
    (``hf_config``, when known, adds the head-count check of ``parallel.sp``)."""
    tp, pp = mesh["tp"].size(), mesh["pp"].size()
    sp = mesh["sp"].size() if "sp" in (mesh.mesh_dim_names or ()) else 1
    check_sp(sp, hf_config, tp=tp, pp=pp, use_remove_padding=model_cfg.use_remove_padding)
    if model_cfg.use_remove_padding and pp > 1:
        raise ConfigError(f"model.use_remove_padding: padding-free passes need parallel.pp = 1 (got pp={pp}): the "
                          f"pipeline schedule splits a batch into micro-batches by rows and a packed batch is one row "
                          f"whose sequence boundaries it cannot carry; set model.use_remove_padding=false with pp")
    if hf_config is not None and is_vlm_config(hf_config) and (pp > 1 or sp > 1):
        raise ConfigError(f"model.path: a vision-language model ({hf_config.model_type}) trains with dp and tp only in "
                          f"this version (got pp={pp}, sp={sp}); set parallel.pp = parallel.sp = 1")
    if lora and (tp > 1 or pp > 1):
        raise ConfigError(f"model.lora_rank: LoRA needs parallel.tp = parallel.pp = 1 (got tp={tp}, pp={pp}): the TP "
                          f"plans and pipeline cuts address nn.Linear / decoder modules that peft has wrapped; split "
                          f"LoRA runs with parallel.sp and dp instead")


class PolicyWorker:
    """An HF causal LM in the training layout of ``mesh`` (pp stages, TP, FSDP2); trainable or frozen.

    ``parallel_cfg`` supplies the pipeline schedule and micro-batch count (sizes come from
    the mesh); ``None`` keeps the defaults of :class:`rlhf.schema.config.ParallelConfig`.
    ``self.model`` is an ``nn.Module`` holding this rank's parameters under HF names (the
    FSDP root, or the pipeline stage(s)); ``self.pipeline`` is set when pp > 1.
    """

    def __init__(self, model_cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 path: Optional[str] = None, trainable: bool = True,
                 actor_cfg: Optional[ActorConfig] = None, total_steps: int = 1,
                 build_model: Optional[Callable[[], torch.nn.Module]] = None,
                 parallel_cfg: Optional[ParallelConfig] = None, lora: Optional[bool] = None,
                 batch_invariant: bool = False):
        """`lora`: wrap the model with PEFT LoRA adapters (default: trainable and model.lora_rank > 0).
        `batch_invariant` (rollout.batch_invariant): every forward through rlhf.models.batch_invariant."""
        self.cfg = model_cfg
        self.actor_cfg = actor_cfg
        self.mesh = mesh
        self.device = device
        self.dp_group = mesh["dp"].get_group()
        self.lora = trainable and model_cfg.lora_rank > 0 if lora is None else lora
        # Deferred: each rank reads only its shards, in the checkpoint dtype, at placement (not under
        # LoRA: peft would create its adapters on the meta device next to the base weights).
        model = build_model() if build_model else load_causal_lm(
            path or model_cfg.path, dtype=model_cfg.dtype, attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code, deferred=not self.lora)
        if not trainable:
            model.requires_grad_(False)
        elif model_cfg.freeze_vision_tower:
            visual = vision_tower(model)
            if visual is None:
                raise ConfigError(f"model.freeze_vision_tower: {path or model_cfg.path} has no vision tower")
            visual.requires_grad_(False)
        self.hf_config = model.config
        self.is_vlm = is_vlm_config(model.config)
        check_features(model_cfg, mesh, self.lora, self.hf_config)
        self.prefix_grouping = resolve_mode(
            model_cfg.prefix_grouping, use_remove_padding=model_cfg.use_remove_padding, sp=_size(mesh, "sp"),
            tp=_size(mesh, "tp"), pp=_size(mesh, "pp"), vlm=self.is_vlm,
            moe=is_moe(self.hf_config))
        if self.lora:
            # Only the adapters are trainable (and so sharded with gradients / optimizer state).
            model = apply_lora(model, lora_rank=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                               target_modules=model_cfg.target_modules)
        # actor.fp8: torchao float8 layers, converted before FSDP2 wraps them (rlhf/models/fp8_training.py)
        self.fp8_share = apply_fp8_training(model, device, all_gather=actor_cfg.fp8_all_gather) \
            if trainable and actor_cfg is not None and actor_cfg.fp8 else None
        self.parallel: ParallelModel = parallelize_model(
            model, mesh, parallel_cfg or ParallelConfig(), device, mixed_precision=model_cfg.mixed_precision,
            param_offload=model_cfg.param_offload, load_ranks_per_node=model_cfg.load_ranks_per_node,
            activation_checkpointing=trainable and model_cfg.enable_gradient_checkpointing,
            fsdp_unit=model_cfg.fsdp_unit)
        del model  # with pp, the other stages' layers are freed here
        adopt_layout(self, self.parallel, mesh)
        self.batch_invariant = batch_invariant and invariant.install_or_refuse(self.model, self.hf_config)
        # (not under pp: the schedule splits rows into micro-batches the padding mask cannot follow)
        self.router_stats = _router_stats(self.model, self.hf_config) \
            if trainable and self.pipeline is None and not self.batch_invariant else None  # (no HF router calls)
        self.router_replay = _router_replay(self.model, self.hf_config, actor_cfg, self.sp_group, trainable,
                                            self.pipeline is not None)
        self.optimizer = self.scheduler = None
        self.total_steps = total_steps
        self.entropy_coeff = actor_cfg.entropy_coeff if actor_cfg is not None else 0.0
        self.nonfinite = NonFiniteGuard("actor", "lower actor.lr or check the data")
        if trainable:
            assert actor_cfg is not None
            self.optimizer = build_optimizer(self.model.parameters(), lr=actor_cfg.lr,
                                             weight_decay=actor_cfg.weight_decay, betas=actor_cfg.betas)
            self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                             warmup_steps=actor_cfg.lr_warmup_steps,
                                             warmup_ratio=actor_cfg.lr_warmup_steps_ratio,
                                             style=actor_cfg.warmup_style, min_lr_ratio=actor_cfg.min_lr_ratio)

    # ------------------------------------------------------------------ forward-only

    def forward_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, response_length: int,
                          temperature: float, compute_entropy: bool = False, multi_modal: Optional[list] = None,
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Teacher-forced log-probs [B, R] (and entropy [B, R]) of the last R tokens (no pipeline).

        Entry t scores ``input_ids[:, L-R+t]`` from the logits at ``L-R+t-1``. Under TP the
        logits stay a vocab-sharded DTensor and are reduced with three scalars per token.
        ``multi_modal``: the rows' images (``RolloutBatch.multi_modal`` of these rows) of a
        vision-language model; a micro-batch without any runs the tower on a dummy image.
        """
        R = response_length
        if self.router_stats is not None:  # padding rows are routed in the padded forward, not counted
            self.router_stats.mask = None if self.cfg.use_remove_padding else attention_mask
        if self.router_replay is not None:  # the tokens this forward routes, in the batch layout
            self.router_replay.tokens = attention_mask if self.cfg.use_remove_padding else None
            self.router_replay.pad_mask = None if self.cfg.use_remove_padding else attention_mask
        mm = collate_multi_modal(multi_modal or [])
        if mm is None and self.is_vlm:  # keeps the tower's FSDP2 collectives in step with ranks that have images
            with dummy_image_forward(self.model, self.device):
                return self._forward_log_probs(input_ids, attention_mask, R, temperature, compute_entropy, mm)
        return self._forward_log_probs(input_ids, attention_mask, R, temperature, compute_entropy, mm)

    def _forward_log_probs(self, input_ids, attention_mask, R, temperature, compute_entropy, mm):
        if self.batch_invariant:
            return invariant.invariant_log_probs(self.model, input_ids, attention_mask, response_length=R,
                                                 temperature=temperature, compute_entropy=compute_entropy)
        if self.cfg.use_remove_padding:
            return packed_forward_log_probs(self.model, input_ids, attention_mask, response_length=R,
                                            temperature=temperature, compute_entropy=compute_entropy,
                                            sp_group=self.sp_group, multi_modal=mm,
                                            prefix_grouping=self.prefix_grouping)
        extra = padded_inputs(self.model, input_ids, attention_mask, mm) if mm is not None else \
            {"position_ids": position_ids_from_mask(attention_mask)}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=R + 1,
                         **extra)
        logits = out.logits[:, :-1]  # [B, R, V] (or its vocab shard)
        labels = input_ids[:, -R:]
        if isinstance(logits, DTensor):
            return log_probs_from_logits(logits, labels, temperature=temperature, compute_entropy=compute_entropy)
        return token_log_probs(logits, labels, temperature, compute_entropy)

    def _pp_mode(self, temperature: float, compute_entropy: bool) -> None:
        # The last stage computes log-probs itself; its settings are plain attributes.
        self.pipeline.compute_entropy = compute_entropy
        for stage in self.pipeline.stages:
            stage.temperature, stage.compute_entropy = temperature, compute_entropy

    def _pp_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, response_length: int,
                    temperature: float, compute_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Pipelined forward of B rows; pads B up to a multiple of the micro-batch count."""
        self._pp_mode(temperature, compute_entropy)
        rows, k = input_ids.shape[0], self.pipeline.n_microbatches
        pad = (-rows) % k
        if pad:  # repeat the last row; its outputs are dropped
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(pad, -1)])
            attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(pad, -1)])
        out = self.pipeline.forward(input_ids, attention_mask)[:rows]  # [B, L] or [B, L, 2]
        R = response_length
        if compute_entropy:
            return out[:, -R:, 0], out[:, -R:, 1]
        return out[:, -R:], None

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                          compute_entropy: bool = False, record_routes: bool = False
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs [N, R] (and entropy [N, R]) of the batch's responses, in eval mode.

        Without pp: micro-batches of ``micro_batch_size`` rows. With pp: pipelined calls of
        ``micro_batch_size x pp_microbatches`` rows (one pipeline flush per call).
        ``record_routes`` (the old-log-prob pass of a MoE actor): the routers' choices go to
        ``batch.routes``, unless it holds the rollout's routes, which are replayed (R3) or compared
        (``rlhf.models.router_replay``).
        """
        self.model.eval()
        replay = self.router_replay
        recording = replay is not None and replay.begin_pass(batch, record_routes)
        lps, ents = [], []
        if self.pipeline is not None:
            chunks = list(split_rows(len(batch), micro_batch_size * self.pipeline.n_microbatches))
            fwd = self._pp_forward
        else:
            chunks = self._micro_batches(batch, micro_batch_size, self.actor_cfg.log_prob_max_token_len_per_gpu
                                         if self.actor_cfg is not None else None)
            fwd = self.forward_log_probs
        for rows in chunks:
            if len(rows) == 0:  # a rank with fewer rows: still run the FSDP collectives
                fwd(batch.input_ids[:1], batch.attention_mask[:1], response_length=batch.response_length,
                    temperature=temperature, compute_entropy=False)
                continue
            mm = {"multi_modal": [batch.multi_modal[i] for i in rows.tolist()]} if batch.multi_modal else {}
            if recording:
                replay.record_into = torch.zeros_like(batch.routes[rows])
            elif replay is not None:
                replay.reference = None if batch.routes is None else batch.routes[rows]
            lp, ent = fwd(batch.input_ids[rows], batch.attention_mask[rows], response_length=batch.response_length,
                          temperature=temperature, compute_entropy=compute_entropy, **mm)
            if recording:
                batch.routes[rows], replay.record_into = replay.record_into, None
            elif replay is not None:
                replay.reference = None
            lps.append(lp)
            ents.append(ent)
        order = torch.cat([torch.as_tensor(r, dtype=torch.long) for r in chunks])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        log_probs = torch.cat(lps)[inverse.to(self.device)] if lps else \
            batch.rollout_log_probs.new_zeros(0, batch.response_length)
        entropy = torch.cat(ents)[inverse.to(self.device)] if compute_entropy and ents else None
        return log_probs, entropy

    @torch.no_grad()
    def compute_sum_pi_squared(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int) -> torch.Tensor:
        """``sum_v pi_t(v)^2`` [N, R] of ``softmax(logits / T)`` at each response step (for the
        optimal token baselines).  A separate forward pass over the padded rows: it needs the
        full vocab distribution, which the log-prob paths reduce away; tp/pp are refused at
        start-up (see RLTrainer._check_names)."""
        self.model.eval()
        R = batch.response_length
        out = batch.rollout_log_probs.new_zeros(len(batch), R)
        for rows in list(split_rows(len(batch), micro_batch_size)) or [torch.arange(0)]:
            ids, mask = (batch.input_ids[rows], batch.attention_mask[rows]) if len(rows) else \
                (batch.input_ids[:1], batch.attention_mask[:1])  # keep FSDP collectives in step
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
            if len(rows):
                out[rows.to(out.device)] = sum_pi_squared_from_logits(logits.float() / temperature)
        return out

    def _micro_batches(self, batch: RolloutBatch, size: int, token_budget: Optional[int]) -> list[torch.Tensor]:
        """Row indices per micro-batch: fixed `size`, or (actor.use_dynamic_bsz) a token budget
        per micro-batch with the same micro-batch count on every dp rank."""
        if self.actor_cfg is None or not self.actor_cfg.use_dynamic_bsz or token_budget is None:
            return list(split_rows(len(batch), size))
        seq_lens = batch.attention_mask.sum(-1).tolist()
        # verl's convention: the per-GPU budget times sp is the budget of one sp group's micro-batch.
        token_budget *= sp_size(self.sp_group)
        groups = micro_batches_for_rank(seq_lens, token_budget, group=self.dp_group, device=self.device)
        return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]

    # ------------------------------------------------------------------ update

    def update_policy(self, batch: RolloutBatch, *, mini_batch_rows: int, temperature: float,
                      max_response_length: int, old_log_probs_current: bool = False) -> dict[str, float]:
        """PPO epochs over mini-batches of `mini_batch_rows` local rows; one optimizer step each.

        Requires batch.old_log_probs, batch.advantages (and ref_log_probs when use_kl_loss).
        ``old_log_probs_current``: batch.old_log_probs are this actor's own at its current weights
        (then the first mini-batch's zero-advantage rows need no forward: rlhf/train/grad_free.py).
        """
        cfg = self.actor_cfg
        assert cfg is not None and self.optimizer is not None
        loss_fn = get_policy_loss(cfg.policy_loss)
        low = cfg.clip_ratio_low if cfg.clip_ratio_low >= 0 else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high >= 0 else cfg.clip_ratio
        mode = cfg.loss_agg_mode
        params = loss_params(cfg)
        # scheduler.last_epoch counts finished updates (restored on resume)
        self.entropy_coeff = entropy_coeff_at(self.scheduler.last_epoch, self.total_steps, cfg.entropy_coeff,
                                              cfg.entropy_coeff_final, cfg.entropy_coeff_schedule)
        self.model.train()
        cov_sums: list[torch.Tensor] = []  # read on the host once, after the update

        skip = skips_grad_free_rows(cfg, self.entropy_coeff, moe=self.router_stats is not None or
                                    self.router_replay is not None, pipeline=self.pipeline is not None)
        calls = [0]  # mini-batch steps so far: the first runs at the weights of the old log-probs

        def mini_step(mini: RolloutBatch, norm: AggNorm, metrics: MetricSums, split=None) -> torch.Tensor:
            calls[0] += 1
            sums = all_reduce_sum(covariance_sums(mini.old_log_probs, mini.advantages, mini.response_mask),
                                  self.dp_group)
            cov_sums.append(sums)
            if cfg.policy_loss in COV_LOSSES:  # one selection per mini-batch over all its tokens
                mini.cov_select = select_cov_tokens(cfg.policy_loss, mini.old_log_probs, mini.advantages,
                                                    mini.response_mask, params, sums, self.dp_group)
            terms = dict(pg_fn=loss_fn, low=low, high=high, mode=mode, norm=norm, params=params)
            if split is not None:
                return split_mini_step(self, mini, split, terms, temperature, metrics,
                                       on_policy=old_log_probs_current and calls[0] == 1)
            step = self._pp_mini_step if self.pipeline is not None else self._mini_step
            return step(mini, terms, temperature, metrics)

        with self.router_stats.record() if self.router_stats is not None else nullcontext():
            out = run_ppo_epochs(self, batch, mini_batch_rows=mini_batch_rows, epochs=cfg.ppo_epochs,
                                 shuffle=cfg.shuffle, max_response_len=max_response_length, grad_clip=cfg.grad_clip,
                                 prefix="actor", loss_name="loss", mini_step=mini_step,
                                 row_split=(lambda m: grad_free_rows(m.advantages, m.response_mask)) if skip else None)
        if self.router_stats is not None:  # MoE: expert load and router entropy of the update's forwards
            out.update(self.router_stats.reduce(self.device, self.mesh_group))
        if self.router_replay is not None:
            self.router_replay.reference = None
            out.update(self.router_replay.mismatch(self.device, self.mesh_group))
        out["actor/entropy_coeff"] = self.entropy_coeff
        if self.fp8_share is not None:
            out["perf/fp8"] = self.fp8_share
        covs = [covariance_from_sums(row) for row in torch.stack(cov_sums).tolist()] if cov_sums else []
        out["actor/cov_logp_adv"] = sum(covs) / max(len(covs), 1)
        return out

    def _mini_step(self, mini: RolloutBatch, terms: dict, temperature: float, metrics: MetricSums) -> torch.Tensor:
        """Gradient accumulation over micro-batches; returns this rank's loss sum (float64)."""
        cfg = self.actor_cfg
        micro_list = self._micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
        return self._grad_pass(mini, micro_list, terms, temperature, metrics, mini)

    def _grad_pass(self, mini: RolloutBatch, micro_list: list, terms: dict, temperature: float, metrics: MetricSums,
                   dummy: RolloutBatch) -> torch.Tensor:
        """Forward, loss and backward over ``micro_list`` (row indices into ``mini``); an empty entry runs
        a zero-weight pass on ``dummy``'s first row. Returns this rank's loss sum (float64)."""
        cfg = self.actor_cfg
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, rows in enumerate(micro_list):
            set_grad_sync(self.model, self.cfg, last=k == len(micro_list) - 1)
            if len(rows) == 0:
                # This rank has fewer rows than the agreed micro-batch count: a zero-weight
                # pass keeps its FSDP collectives in step with the other ranks.
                if self.router_replay is not None:
                    self.router_replay.reference = None
                with self.router_stats.paused() if self.router_stats is not None else nullcontext():
                    lp, _ = self.forward_log_probs(dummy.input_ids[:1], dummy.attention_mask[:1],
                                                   response_length=dummy.response_length, temperature=temperature)
                (lp.sum() * 0.0).backward()
                continue
            mb = mini.select(rows)
            if self.router_replay is not None:
                self.router_replay.reference = mb.routes
                self.router_replay.collect_aux(True)
            log_probs, entropy = self.forward_log_probs(mb.input_ids, mb.attention_mask,
                                                        response_length=mb.response_length, temperature=temperature,
                                                        compute_entropy=_needs_entropy(cfg),
                                                        multi_modal=mb.multi_modal)
            loss, parts = self._loss(log_probs, entropy, mb.response_mask, mb.old_log_probs, mb.advantages,
                                     mb.rollout_log_probs, mb.ref_log_probs, cov_select=mb.cov_select,
                                     is_weights=mb.rollout_is_weights, **terms)
            aux = self.router_replay.collect_aux(False) if self.router_replay is not None else None
            if aux is not None:  # the mean over the mini-batch's micro-batches of all dp ranks
                if cfg.router_aux_loss_coef:
                    loss = loss + cfg.router_aux_loss_coef * aux / (len(micro_list) * self.grad_scale)
                metrics.add("moe/aux_loss", aux, 1.0)
            (loss * self.grad_scale).backward()
            step_loss += loss.detach().double()
            w = mb.response_mask.sum()
            for name, value in parts.items():
                metrics.add(name, value, w)
        return step_loss

    def _pp_mini_step(self, mini: RolloutBatch, terms: dict, temperature: float,
                      metrics: MetricSums) -> torch.Tensor:
        """One pipelined forward-backward over the mini-batch; the loss runs on the last stage."""
        cfg = self.actor_cfg
        R = mini.response_length
        need_entropy = _needs_entropy(cfg)
        self._pp_mode(temperature, need_entropy)
        inputs = {"response_mask": mini.response_mask, "old_log_probs": mini.old_log_probs,
                  "advantages": mini.advantages, "rollout_log_probs": mini.rollout_log_probs}
        if cfg.use_kl_loss:
            inputs["ref_log_probs"] = mini.ref_log_probs
        if mini.cov_select is not None:
            inputs["cov_select"] = mini.cov_select
        if mini.rollout_is_weights is not None:
            inputs["is_weights"] = mini.rollout_is_weights

        calls: list[tuple[dict, float]] = []

        def stage_loss(log_probs, entropy=None, *, response_mask, old_log_probs, advantages, rollout_log_probs,
                       ref_log_probs=None, cov_select=None, is_weights=None):
            # log_probs [b, L] aligned with input_ids: the response is the last R columns.
            loss, parts = self._loss(log_probs[:, -R:], None if entropy is None else entropy[:, -R:], response_mask,
                                     old_log_probs, advantages, rollout_log_probs, ref_log_probs,
                                     cov_select=cov_select, is_weights=is_weights, **terms)
            calls.append(({k: v.detach() for k, v in parts.items()}, response_mask.sum()))  # no host sync
            return loss * self.grad_scale

        total = self.pipeline.forward_backward(mini.input_ids, mini.attention_mask, stage_loss, inputs)
        # The schedule's shape inference calls the loss once more on placeholder data before
        # the real micro-batches; only the last n_microbatches calls are real.
        for parts, w in calls[len(calls) - self.pipeline.n_microbatches:] if calls else []:
            for name, value in parts.items():
                metrics.add(name, value, w)
        return total.double() / self.grad_scale

    def _loss(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], mask: torch.Tensor,
              old_log_probs: torch.Tensor, advantages: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
              ref_log_probs: Optional[torch.Tensor], *, pg_fn, low: float, high: float, mode: str, norm: AggNorm,
              params: PolicyLossParams, cov_select: Optional[torch.Tensor] = None,
              is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-style loss of one micro-batch ([b, R] tensors), normalised by the global `norm`:

        L = L_pg - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref)).
        """
        cfg = self.actor_cfg
        pg_loss, pg_metrics = pg_fn(old_log_probs, log_probs, advantages, mask,
                                    clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cfg.clip_ratio_c,
                                    loss_agg_mode=mode, norm=norm, rollout_log_probs=rollout_log_probs,
                                    tis_imp_ratio_cap=cfg.tis_imp_ratio_cap, rollout_is_weights=is_weights,
                                    params=params, cov_select=cov_select)
        loss = pg_loss
        parts = {f"actor/{k}": v for k, v in pg_metrics.items()}
        if entropy is not None and self.entropy_coeff != 0:
            loss = loss - self.entropy_coeff * agg_loss(entropy, mask, mode, norm)
        if cfg.use_kl_loss:
            kl = kl_penalty(log_probs, ref_log_probs, cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, mode, norm)
            parts["actor/kl_loss"] = _masked_mean(kl.detach(), mask)
        return loss, parts


def set_grad_sync(model: torch.nn.Module, model_cfg: ModelConfig, *, last: bool) -> None:
    """Before a micro-batch's backward: FSDP2 reduce-scatters its gradients into the sharded
    ``.grad`` at once (default), or, with ``model.unsharded_grad_accumulation``, only on the
    ``last`` micro-batch of the mini-batch, holding unsharded gradients until then."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last or not model_cfg.unsharded_grad_accumulation)


def _router_stats(model: torch.nn.Module, hf_config) -> Optional[RouterStats]:
    """Routing metrics hooks for a MoE model (None for a dense one)."""
    if not is_moe(hf_config):
        return None
    spec = MoESpec.from_config(hf_config)
    return RouterStats(model, [i for i, sparse in enumerate(spec.sparse) if sparse], spec.num_experts)


def _router_replay(model: torch.nn.Module, hf_config, cfg: Optional[ActorConfig], sp, trainable: bool, pp: bool
                   ) -> Optional[RouterReplay]:
    mode = cfg.router_replay if cfg is not None else "none"
    if pp and (mode != "none" or (trainable and cfg.router_aux_loss_coef)):
        raise ConfigError("actor.router_replay / router_aux_loss_coef are not supported with parallel.pp > 1; "
                          "set them to none / 0")
    try:
        replay = None if pp else build_router_replay(model, hf_config, mode, sp, trainable)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if replay is None and trainable and cfg is not None and cfg.router_aux_loss_coef:
        raise ConfigError("actor.router_aux_loss_coef > 0 needs a mixture-of-experts actor without parallel.sp / pp; set it to 0")
    return replay


def _needs_entropy(cfg: ActorConfig) -> bool:
    """Whether any update of the run uses the entropy bonus (constant or scheduled)."""
    return cfg.entropy_coeff != 0 or (cfg.entropy_coeff_schedule != "constant" and cfg.entropy_coeff_final != 0)


def loss_params(cfg: ActorConfig) -> PolicyLossParams:
    """The loss-specific settings of ``cfg`` (actor.clip_cov_*, dro_beta, tau_*, rollout_is...)."""
    return PolicyLossParams(clip_cov_ratio=cfg.clip_cov_ratio, clip_cov_lb=cfg.clip_cov_lb, clip_cov_ub=cfg.clip_cov_ub,
                            kl_cov_ratio=cfg.kl_cov_ratio, ppo_kl_coef=cfg.ppo_kl_coef,
                            dro_beta=cfg.dro_beta if cfg.dro_beta > 0 else None, tau_pos=cfg.tau_pos,
                            tau_neg=cfg.tau_neg, rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
                            loss_type=cfg.rollout_correction_loss_type)


def _size(mesh: DeviceMesh, dim: str) -> int:
    return mesh[dim].size() if dim in (mesh.mesh_dim_names or ()) else 1


def sp_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)
