"""One rollout window: reshard the actor into a rollout copy, sample, free the copy.

Produces the fixed-shape `RolloutBatch` the training phases consume: prompts left-padded
to `max_prompt_length`, responses right-padded to `max_response_length`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf.batch import RolloutBatch
from rlhf.config import RolloutConfig
from rlhf.rollout.reshard import gather_rollout_weights
from rlhf.rollout.sampler import RolloutOutput, Sampler, SamplingParams


@dataclass
class PromptBatch:
    """This rank's prompts for a step (global dataset indices keep sampling layout-invariant)."""

    prompt_ids: list[list[int]]
    keys: list[int]
    ground_truths: list[str]
    data_sources: list[str]
    extra_infos: list[dict]


def stop_sequences(tokenizer, stop: list[str]) -> list[list[int]]:
    return [tokenizer.encode(s, add_special_tokens=False) for s in stop if s]


def stop_token_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if i is not None]


class RolloutEngine:
    """Owns the sampling settings; each call reshards, generates and drops the weights."""

    def __init__(self, cfg: RolloutConfig, tokenizer, *, max_prompt_length: int, max_response_length: int,
                 device: torch.device, dtype: Optional[torch.dtype] = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.P = max_prompt_length
        self.R = max_response_length
        self.device = device
        self.dtype = dtype
        self.pad_id = tokenizer.pad_token_id
        self._stop_ids = stop_token_ids(tokenizer)
        self._stop_seqs = stop_sequences(tokenizer, list(cfg.stop))

    def sampling_params(self, *, n: int, temperature: float, seed: int) -> SamplingParams:
        greedy = temperature == 0
        return SamplingParams(n=n, temperature=temperature, top_k=-1 if greedy else self.cfg.top_k,
                              top_p=1.0 if greedy else self.cfg.top_p, min_p=0.0 if greedy else self.cfg.min_p,
                              max_new_tokens=self.R, stop_token_ids=self._stop_ids,
                              stop_sequences=self._stop_seqs, seed=seed)

    def generate(self, model: torch.nn.Module, hf_config, prompts: PromptBatch, *, step: int, n: int,
                 temperature: float) -> tuple[RolloutBatch, dict[str, float]]:
        """Reshard `model` (training layout) -> rollout copy -> sample -> RolloutBatch."""
        t0 = time.perf_counter()
        weights, rs = gather_rollout_weights(model, dtype=self.dtype)
        t1 = time.perf_counter()
        sampler = Sampler(hf_config, weights, pad_token_id=self.pad_id, device=self.device, dtype=self.dtype,
                          max_num_seqs=self.cfg.max_num_seqs, max_seq_len=self.P + self.R,
                          kv_cache_tokens=self.cfg.kv_cache_tokens or None)
        params = self.sampling_params(n=n, temperature=temperature, seed=self.cfg.seed)
        out = sampler.generate(prompts.prompt_ids, params, step=step, prompt_keys=prompts.keys)
        del sampler, weights  # the rollout copy lives only for this window
        t2 = time.perf_counter()
        batch = self.to_batch(prompts, out, n)
        stats = {"timing/reshard": t1 - t0, "timing/generate": t2 - t1,
                 "reshard/bytes_received": float(rs.bytes_received), "reshard/params": float(rs.numel)}
        for k, v in out.stats.items():
            stats[f"rollout/{k}"] = float(v)
        return batch, stats

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
        resp_mask = torch.zeros((N, R), dtype=torch.float32)
        resp_mask[:, :r] = out.response_mask[:, :r].cpu().float()
        rollout_lp = torch.zeros((N, R), dtype=torch.float32)
        rollout_lp[:, :r] = out.log_probs[:, :r].cpu().float()
        responses = torch.where(resp_mask.bool(), responses, torch.full_like(responses, self.pad_id))
        input_ids = torch.cat([prompt_tensor, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, resp_mask.long()], dim=1)
        texts = self.tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(responses, resp_mask)],
                                            skip_special_tokens=True)
        pick = prompt_idx.tolist()
        batch = RolloutBatch(
            input_ids=input_ids, attention_mask=attention_mask, responses=responses, response_mask=resp_mask,
            index=torch.tensor([prompts.keys[i] for i in pick], dtype=torch.long),
            rollout_log_probs=rollout_lp, truncated=out.truncated.cpu().bool(),
            response_texts=texts, ground_truths=[prompts.ground_truths[i] for i in pick],
            data_sources=[prompts.data_sources[i] for i in pick], extra_infos=[prompts.extra_infos[i] for i in pick])
        return batch.to(self.device)
