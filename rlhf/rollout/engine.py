"""One rollout window: reshard the actor into the rollout layout, sample, free the weights.

Produces the fixed-shape `RolloutBatch` the training phases consume: prompts left-padded
to `max_prompt_length`, responses right-padded to `max_response_length`.

Layouts. Given the *global* prompt batch and the rows this training rank owns
(``local_rows``, mini-batch-major order, see ``rlhf.schema.batch.minibatch_major_shard``), the
prompts are split into ``rollout.dp = world / rollout.tp`` contiguous chunks, one per
rollout replica (a rollout TP group generates one chunk together). The generated rows
are then all-gathered over the ranks that share a rollout-TP rank (token ids, lengths
and sampler log-probs: small next to the weights) and each rank keeps the rows of its
own prompts. Sampling randomness is keyed by (seed, step, global prompt index, sample),
so the responses do not depend on which replica generated them.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf.models.lora import merged_weights_for_rollout
from rlhf.rollout.abort import EarlyStop
from rlhf.rollout.exchange import exchange_rows
from rlhf.rollout.reshard import ReshardStats, RolloutLayout, gather_rollout_weights, quantize_rollout_weights
from rlhf.rollout.routes import batch_routes
from rlhf.rollout.sampler import RolloutOutput, Sampler, SamplingParams
from rlhf.rollout.speculative import SPEC_STATS, derived_stats
from rlhf.rollout.turns import TurnHandler
from rlhf.schema.batch import PromptBatch, RolloutBatch
from rlhf.schema.config import RolloutConfig


def rollout_dtype(name: str, device_type: str, model_dtype: str) -> torch.dtype:
    """``rollout.dtype`` resolved: "auto" = bfloat16 on CUDA, else the master dtype (``model.dtype``)."""
    if name == "auto":
        name = "bfloat16" if device_type == "cuda" else model_dtype
    return getattr(torch, name)


def decode_responses(tokenizer, responses: torch.Tensor, in_trajectory: torch.Tensor) -> list[str]:
    """The text of each response row ``[N, R]``: its tokens under ``in_trajectory`` (the whole trajectory,
    tool outputs included, as the reward function sees it), special tokens skipped."""
    return tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(responses.cpu(), in_trajectory.cpu())],
                                  skip_special_tokens=True)


def chunk_bounds(num_prompts: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, end) chunks of ``num_prompts`` over ``parts`` replicas."""
    base, extra = divmod(num_prompts, parts)
    bounds, start = [], 0
    for q in range(parts):
        end = start + base + (1 if q < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# Sampler stats summed over the rollout replicas (counts); the others take the slowest / largest replica.
_SUMMED_STATS = ("tokens_generated", "num_sequences", "decode_steps", "prefill_calls", "prefill_tokens",
                 "prefill_padded_tokens", "compaction_moves", "preemptions", "recomputed_tokens", "kv_shared_blocks")
MULTI_TURN_STATS = ("turns", "observation_tokens", "parked_preemptions")  # reported with a TurnHandler
_MAX_STATS = ("seconds", "prefill_s", "decode_s", "num_slots", "kv_cache_bytes", "kv_cache_tokens", "kv_peak_tokens")


def global_rollout_stats(local: dict[str, float], group: Optional[dist.ProcessGroup],
                         multi_turn: bool = False, speculative: bool = False,
                         over_sampling: bool = False) -> dict[str, float]:
    """One replica's sampler stats -> the rollout's: counts summed over the replicas in ``group`` (one rank
    per replica), times and cache sizes their maximum, ``tokens_per_s`` = all tokens / the slowest replica,
    ``slot_utilisation`` the replicas' mean. A replica with no prompts (empty ``local``) contributes zeros;
    the keys are fixed, so every replica takes part in the same two all-reduces."""
    summed_keys = _SUMMED_STATS + (MULTI_TURN_STATS if multi_turn else ()) + (SPEC_STATS if speculative else ()) \
        + (("aborted",) if over_sampling else ())
    max_keys = _MAX_STATS + (("over_sample_saved_s",) if over_sampling else ())
    summed = torch.tensor([float(local.get(k, 0.0)) for k in summed_keys + ("slot_utilisation",)]
                          + [float(bool(local))], dtype=torch.float64)
    maxed = torch.tensor([float(local.get(k, 0.0)) for k in max_keys], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        summed, maxed = summed.to(dev), maxed.to(dev)
        dist.all_reduce(summed, group=group)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
    sums, maxes = summed.tolist(), maxed.tolist()
    out = dict(zip(summed_keys, sums))
    out.update(zip(max_keys, maxes))
    out["slot_utilisation"] = sums[-2] / max(sums[-1], 1.0)  # mean over the replicas that decoded
    out["tokens_per_s"] = out["tokens_generated"] / out["seconds"] if out["seconds"] > 0 else 0.0
    if speculative:
        out.update(derived_stats(out))
    return out


# (prompt position in the global batch, sample index) pairs and their response token ids
OnFinished = Callable[[list[tuple[int, int]], list[list[int]]], None]


def _rows_to_samples(fn: Optional[OnFinished], first_prompt: int, n: int):
    """The sampler's output rows (``prompt * n + sample`` within a chunk) -> global (prompt, sample)."""
    if fn is None:
        return None
    return lambda rows, ids: fn([(first_prompt + r // n, r % n) for r in rows], ids)


def stop_sequences(tokenizer, stop: list[str]) -> list[list[int]]:
    return [tokenizer.encode(s, add_special_tokens=False) for s in stop if s]


def stop_token_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if i is not None]


class RolloutEngine:
    """Owns the sampling settings; each call reshards, generates and drops the weights."""

    def __init__(self, cfg: RolloutConfig, tokenizer, *, max_prompt_length: int, max_response_length: int,
                 device: torch.device, dtype: Optional[torch.dtype] = None, layout: Optional[RolloutLayout] = None,
                 lora: Optional[tuple[float, int]] = None, record_routes: bool = False):
        """`lora`: (lora_alpha, lora_rank) when the actor is a PEFT LoRA model. ``record_routes``: a MoE
        sampler records each token's experts into ``RolloutBatch.routes`` (``rlhf.rollout.routes``)."""
        self.cfg = cfg
        self.record_routes = record_routes
        self.lora = lora
        self._lora_base: Optional[dict[str, torch.Tensor]] = None
        self._kept: Optional[Sampler] = None  # the run-long sampler (free_cache_engine=False or CUDA graphs)
        self.layout = layout or RolloutLayout()
        self.tokenizer = tokenizer
        self.P = max_prompt_length
        self.R = max_response_length
        self.device = device
        self.dtype = dtype
        self.pad_id = tokenizer.pad_token_id
        self._stop_ids = stop_token_ids(tokenizer)
        self._stop_seqs = stop_sequences(tokenizer, list(cfg.stop))

    def sampling_params(self, *, n: int, temperature: float, seed: int, top_p: Optional[float] = None,
                        top_k: Optional[int] = None) -> SamplingParams:
        """``top_p`` / ``top_k``: overrides of the rollout config's (e.g. validation's own)."""
        greedy = temperature == 0
        top_k = self.cfg.top_k if top_k is None else top_k
        top_p = self.cfg.top_p if top_p is None else top_p
        return SamplingParams(n=n, temperature=temperature, top_k=-1 if greedy else top_k,
                              top_p=1.0 if greedy else top_p, min_p=0.0 if greedy else self.cfg.min_p,
                              max_new_tokens=self.R, stop_token_ids=self._stop_ids,
                              stop_sequences=self._stop_seqs, seed=seed)

    def _rollout_weights(self, model: torch.nn.Module, pp_group) -> tuple[dict[str, torch.Tensor], ReshardStats]:
        """Rollout weights of `model`. With LoRA, the frozen base is resharded once and cached,
        and each call moves only the adapters and merges ``W + (alpha / r) B A``."""
        lay = self.layout
        kw = dict(dtype=self.dtype, pp_group=pp_group, tp_rank=lay.tp_rank, tp_size=lay.tp, tp_group=lay.tp_group,
                  ep_rank=lay.ep_rank, ep_size=lay.ep, ep_group=lay.ep_group)
        quant = dict(quantization=self.cfg.quantization or None, quantization_scale=self.cfg.quantization_scale)
        if self.lora is None:
            return gather_rollout_weights(model, **kw, **quant)
        if self._lora_base is None:
            self._lora_base, _ = gather_rollout_weights(model, name_filter=lambda n: ".lora_" not in n, **kw)
        # The adapters whole (small); under a TP rollout B @ A is cut like the base weight it adds to.
        adapters, rs = gather_rollout_weights(model, name_filter=lambda n: ".lora_" in n,
                                              **{**kw, "tp_rank": 0, "tp_size": 1})
        alpha, rank = self.lora
        slicer = None
        if lay.tp > 1 or lay.ep > 1:
            from rlhf.rollout.reshard import rollout_slice

            config = next((m.config for m in model.modules()
                           if hasattr(getattr(m, "config", None), "model_type")), None)
            slicer = lambda full, name: rollout_slice(full, name, lay.tp_rank, lay.tp, config,  # noqa: E731
                                                      lay.ep_rank, lay.ep)
        merged = merged_weights_for_rollout(self._lora_base, adapters, alpha, rank, slice_delta=slicer)
        return quantize_rollout_weights(merged, **quant), rs  # W + BA quantized, as the base alone would be

    def _sampler(self, hf_config, weights: dict[str, torch.Tensor], consume: bool) -> Sampler:
        """A sampler holding ``weights`` (``consume``: the dict is handed over and emptied). With
        ``rollout.free_cache_engine=False`` or CUDA graphs (``rollout.compile`` on CUDA) one sampler
        lives for the whole run: its KV cache (and graphs, graph memory pool) are reused each step
        and new weights are copied into its tensors. Otherwise a fresh one per step, so nothing of
        the rollout outlives its window."""
        if self._kept is not None:
            self._kept.load_weights(weights, consume=consume)
            return self._kept
        graphs = self.cfg.compile and self.device.type == "cuda" and self.layout.ep == 1
        keep = graphs or not self.cfg.free_cache_engine
        sampler = Sampler(hf_config, weights, pad_token_id=self.pad_id, device=self.device, dtype=self.dtype,
                          max_num_seqs=self.cfg.max_num_seqs, max_seq_len=self.P + self.R,
                          kv_cache_tokens=self.cfg.kv_cache_tokens or None,
                          kv_cache_bytes=int(self.cfg.kv_cache_memory * 2**30) or None,
                          prefill_tokens=self.cfg.prefill_tokens, tp_group=self.layout.tp_group,
                          use_cuda_graph=graphs, gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                          reload_in_place=keep, consume_weights=consume, speculative=self.cfg.speculative,
                          record_routes=self.record_routes, ep_group=self.layout.ep_group,
                          batch_invariant=self.cfg.batch_invariant)
        if keep:
            self._kept = sampler
        return sampler

    def generate(self, model: torch.nn.Module, hf_config, prompts: PromptBatch, *, step: int, n: int,
                 temperature: float, local_rows: Optional[list[int]] = None,
                 pp_group: Optional[dist.ProcessGroup] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, on_finished: Optional[OnFinished] = None,
                 turns: Optional[TurnHandler] = None, keep_groups: Optional[int] = None,
                 ) -> tuple[RolloutBatch, dict[str, float]]:
        """Reshard `model` (training layout) -> rollout weights -> sample -> RolloutBatch.

        Args:
            model: the training-layout module with HF parameter names (pp: this rank's stage(s)).
            prompts: with ``local_rows``, the *global* batch (identical on every rank);
                without, this rank's own prompts (the global batch is then assembled with
                one ``all_gather_object`` of the prompt lists, de-duplicated by keys).
            local_rows: indices into ``prompts`` of the prompts this rank trains on; the
                returned batch holds their ``n`` samples each, in this order.
            pp_group: the pipeline group when ``model`` is one pipeline stage (default: the
                ``pp_group`` attribute that ``parallelize_model`` sets on stage modules).
            top_p, top_k: override ``rollout.top_p`` / ``rollout.top_k`` for this call.
            on_finished: called as this rank's replica finishes sequences, with their
                ``(prompt position in the global batch, sample)`` pairs and response token ids.
            turns: multi-turn handler of this rank's replica (``rlhf.rollout.turns``); its row
                numbers are the sampler's rows of the replica's chunk (``prompt * n + sample``).
                The batch's ``response_mask`` is then 0 on observation tokens.
            keep_groups: over-sampling (``rollout.over_sample_rate``): the prompt groups the step needs of
                all ``prompts``; every replica aborts the rest of its chunk once that many have finished
                over all replicas (``rlhf.rollout.abort``). ``RolloutBatch.aborted`` flags the rows of
                aborted groups.
        """
        pp_group = pp_group if pp_group is not None else getattr(model, "pp_group", None)
        t0 = time.perf_counter()
        weights, rs = self._rollout_weights(model, pp_group)
        reshard_s = time.perf_counter() - t0
        batch, stats = self.sample(weights, hf_config, prompts, step=step, n=n, temperature=temperature,
                                   local_rows=local_rows, top_p=top_p, top_k=top_k, on_finished=on_finished,
                                   turns=turns, consume_weights=True, keep_groups=keep_groups)
        del weights  # handed over: the sampler took (and dropped) its tensors while fusing them
        if self.device.type == "cuda" and self._kept is None:
            torch.cuda.empty_cache()  # hand the rollout copy and KV cache back before the update
        stats.update({"timing/reshard": reshard_s, "reshard/bytes_received": float(rs.bytes_received),
                      "reshard/params": float(rs.numel)})
        return batch, stats

    def sample(self, weights: dict[str, torch.Tensor], hf_config, prompts: PromptBatch, *, step: int, n: int,
               temperature: float, local_rows: Optional[list[int]] = None, top_p: Optional[float] = None,
               top_k: Optional[int] = None, on_finished: Optional[OnFinished] = None,
               turns: Optional[TurnHandler] = None, consume_weights: bool = False,
               keep_groups: Optional[int] = None) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample with rollout ``weights`` already in this rank's rollout layout (the arguments are
        :meth:`generate`'s); the rollout role of trainer.mode one_step_off calls it with received weights.
        ``consume_weights``: the dict is handed over (emptied as the sampler fuses it: lower peak memory)."""
        lay = self.layout
        t1 = time.perf_counter()
        sampler = self._sampler(hf_config, weights, consume_weights)
        params = self.sampling_params(n=n, temperature=temperature, seed=self.cfg.seed, top_p=top_p, top_k=top_k)
        if local_rows is None and dist.is_initialized() and lay.size > 1:
            prompts, local_rows = self._global_prompts(prompts, lay.group)
        if local_rows is None:
            if hasattr(turns, "set_prompts"):  # per-sample tool kwargs of the rows (rlhf.agent.loop)
                turns.set_prompts(prompts.keys, prompts.extra_infos, n)
            out = sampler.generate(prompts.prompt_ids, params, step=step, prompt_keys=prompts.keys,
                                   on_finished=_rows_to_samples(on_finished, 0, n), turns=turns,
                                   multi_modal=prompts.multi_modal or None,
                                   keep_groups=keep_groups)
            mine = prompts
        else:
            start, end = chunk_bounds(len(prompts.prompt_ids), lay.dp)[lay.dp_rank]
            out = None
            if end > start:
                if hasattr(turns, "set_prompts"):
                    turns.set_prompts(prompts.keys[start:end], prompts.extra_infos[start:end], n)
                out = sampler.generate(prompts.prompt_ids[start:end], params, step=step,
                                       prompt_keys=prompts.keys[start:end],
                                       on_finished=_rows_to_samples(on_finished, start, n), turns=turns,
                                       multi_modal=prompts.multi_modal[start:end] if prompts.multi_modal else None,
                                       keep_groups=keep_groups, count_group=lay.dp_group if lay.dp > 1 else None)
            elif keep_groups is not None and lay.dp > 1:  # nothing of its own: counts with the others
                EarlyStop(keep_groups, 0, n, lay.dp_group).wait_for_peers()
            else:
                sampler.ep_drain()  # rollout.ep: nothing of its own, but its experts serve the peers
            stats_local = dict(out.stats) if out is not None else {}
            out = self._exchange(out, len(prompts.prompt_ids), n, local_rows, sampler.route_shape)
            # global over the rollout replicas (one rank each in lay.dp_group), like every logged metric
            out.stats = global_rollout_stats(stats_local, lay.dp_group if lay.dp > 1 else None, turns is not None,
                                             self.cfg.speculative.enable, keep_groups is not None)
            mine = prompts.subset(local_rows)
        del sampler
        t2 = time.perf_counter()
        batch = self.to_batch(mine, out, n)
        stats = {"timing/generate": t2 - t1}
        for k, v in out.stats.items():
            stats[f"rollout/{k}"] = float(v)
        return batch, stats

    @staticmethod
    def _global_prompts(prompts: PromptBatch, group=None) -> tuple[PromptBatch, list[int]]:
        """Every rank's prompts, de-duplicated (tp / pp peers hold the same ones), and mine in it."""
        pieces = [None] * dist.get_world_size(group)
        dist.all_gather_object(pieces, prompts, group=group)
        unique: list[PromptBatch] = []
        start_of: dict[tuple, int] = {}
        offset = 0
        for piece in pieces:
            key = tuple(piece.keys)
            if key not in start_of:
                start_of[key] = offset
                offset += len(piece.keys)
                unique.append(piece)
        glob = PromptBatch(prompt_ids=[x for p in unique for x in p.prompt_ids],
                           keys=[x for p in unique for x in p.keys],
                           ground_truths=[x for p in unique for x in p.ground_truths],
                           data_sources=[x for p in unique for x in p.data_sources],
                           extra_infos=[x for p in unique for x in p.extra_infos],
                           multi_modal=[x for p in unique for x in (p.multi_modal or [None] * len(p.keys))]
                           if any(p.multi_modal for p in unique) else [])
        start = start_of[tuple(prompts.keys)]
        return glob, list(range(start, start + len(prompts.keys)))

    def _exchange(self, out: Optional[RolloutOutput], num_prompts: int, n: int,
                  local_rows: list[int], route_shape: Optional[tuple[int, int]] = None) -> RolloutOutput:
        """All rollout replicas' rows -> the rows of ``local_rows`` (each prompt's n samples):
        packed narrow, each rank receives only its own (``rlhf.rollout.exchange``). ``route_shape``:
        ``(S, k)`` when the sampler records routes (they travel in the batch layout, ``P + R`` wide)."""
        lay = self.layout
        if out is not None and out.routes is not None:
            out.routes = batch_routes(out.routes, out.routes.shape[1] - out.response_ids.shape[1], self.P)
        return exchange_rows(out, chunk_bounds(num_prompts, lay.dp), n, local_rows, self.R, lay.dp, lay.dp_group,
                             self.device, None if route_shape is None else (self.P + self.R, *route_shape))

    def to_batch(self, prompts: PromptBatch, out: RolloutOutput, n: int) -> RolloutBatch:
        N = len(prompts.prompt_ids) * n
        P, R = self.P, self.R
        prompt_idx = out.prompt_index.cpu()
        # [N, P] left-padded prompts
        prompt_tensor = torch.full((N, P), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((N, P), dtype=torch.long)
        for row, pi in enumerate(prompt_idx.tolist()):
            ids = prompts.prompt_ids[pi][-P:]
            prompt_tensor[row, P - len(ids):] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[row, P - len(ids):] = 1
        # [N, R] right-padded responses
        r = min(R, out.response_ids.shape[1])
        responses = torch.full((N, R), self.pad_id, dtype=torch.long)
        responses[:, :r] = out.response_ids[:, :r].cpu()
        # the loss mask has holes on observation tokens; attention covers the whole trajectory
        resp_mask = torch.zeros((N, R), dtype=torch.float32)
        resp_mask[:, :r] = out.response_mask[:, :r].cpu().float()
        in_traj = torch.arange(R)[None, :] < out.response_lengths.cpu()[:, None]  # [N, R]
        rollout_lp = torch.zeros((N, R), dtype=torch.float32)
        rollout_lp[:, :r] = out.log_probs[:, :r].cpu().float()
        nan = int(rollout_lp[resp_mask.bool()].isnan().sum())  # host tensors: no device sync
        if nan:
            from rlhf.schema.errors import NonFiniteError

            raise NonFiniteError(f"rollout: the policy's logits are not finite ({nan} of {int(resp_mask.sum())} "
                                 f"sampled tokens have a NaN log-prob): its weights hold NaN/inf (check model.path, "
                                 f"or lower actor.lr if training diverged)")
        responses = torch.where(in_traj, responses, torch.full_like(responses, self.pad_id))
        input_ids = torch.cat([prompt_tensor, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, in_traj.long()], dim=1)
        texts = decode_responses(self.tokenizer, responses, in_traj)
        pick = prompt_idx.tolist()
        batch = RolloutBatch(
            input_ids=input_ids, attention_mask=attention_mask, responses=responses, response_mask=resp_mask,
            index=torch.tensor([prompts.keys[i] for i in pick], dtype=torch.long),
            rollout_log_probs=rollout_lp, truncated=out.truncated.cpu().bool(),
            response_texts=texts, ground_truths=[prompts.ground_truths[i] for i in pick],
            data_sources=[prompts.data_sources[i] for i in pick], extra_infos=[prompts.extra_infos[i] for i in pick],
            multi_modal=[prompts.multi_modal[i] for i in pick] if prompts.multi_modal else [],
            aborted=None if out.aborted is None else out.aborted.cpu().bool())
        if out.routes is not None:  # [N, P + R, S, k] like input_ids (prompts cut / padded the same way)
            batch.routes = batch_routes(out.routes.cpu(), out.routes.shape[1] - out.response_ids.shape[1], P)
        return batch.to(self.device)
