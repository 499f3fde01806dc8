"""The typed batches that flow through the RL phases (the prompts of a step, the rollout batch), and
their splitting helpers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class PromptBatch:
    """This rank's prompts for a step (global dataset indices keep sampling layout-invariant)."""

    prompt_ids: list[list[int]]
    keys: list[int]
    ground_truths: list[str]
    data_sources: list[str]
    extra_infos: list[dict]
    # Per prompt: a VLM prompt's images ({"pixel_values", "image_grid_thw"}) or None; empty for text-only data.
    multi_modal: list = field(default_factory=list)

    def subset(self, rows: list[int]) -> "PromptBatch":
        return PromptBatch(prompt_ids=[self.prompt_ids[i] for i in rows], keys=[self.keys[i] for i in rows],
                           ground_truths=[self.ground_truths[i] for i in rows],
                           data_sources=[self.data_sources[i] for i in rows],
                           extra_infos=[self.extra_infos[i] for i in rows],
                           multi_modal=[self.multi_modal[i] for i in rows] if self.multi_modal else [])


@dataclass
class RolloutBatch:
    """All per-sequence data of one step on this rank. N = local prompts x n samples.

    Rows of one prompt are contiguous (row i*n+j = sample j of prompt i), so GRPO groups
    never span ranks.
    """

    input_ids: torch.Tensor            # [N, P+R] left-padded prompt | right-padded response
    attention_mask: torch.Tensor       # [N, P+R] context: 1 on every real token, tool outputs included
    responses: torch.Tensor            # [N, R]
    response_mask: torch.Tensor        # [N, R] float, loss: 1 on generated tokens, 0 on tool outputs / pad
    index: torch.Tensor                # [N] global prompt id (group id)
    rollout_log_probs: torch.Tensor    # [N, R] sampler log-probs
    truncated: torch.Tensor            # [N] bool, hit max_response_length
    token_level_scores: Optional[torch.Tensor] = None   # [N, R] reward on the last token
    token_level_rewards: Optional[torch.Tensor] = None  # [N, R] scores minus in-reward KL
    old_log_probs: Optional[torch.Tensor] = None        # [N, R]
    ref_log_probs: Optional[torch.Tensor] = None        # [N, R]
    teacher_log_probs: Optional[torch.Tensor] = None    # [N, R] distillation teacher (rlhf/train/distill.py)
    values: Optional[torch.Tensor] = None               # [N, R] critic values
    advantages: Optional[torch.Tensor] = None           # [N, R]
    returns: Optional[torch.Tensor] = None              # [N, R]
    reward_baselines: Optional[torch.Tensor] = None     # [N] (ReMax greedy baseline reward)
    acc: Optional[torch.Tensor] = None                  # [N] 1.0 where the response is correct
    cov_select: Optional[torch.Tensor] = None           # [N, R] clip_cov / kl_cov token selection
    reward_components: Optional[torch.Tensor] = None    # [N, K] gdpo: algorithm.gdpo_reward_keys
    sum_pi_squared: Optional[torch.Tensor] = None       # [N, R] optimal token baselines
    rollout_is_weights: Optional[torch.Tensor] = None   # [N, R] rollout-correction loss weights (algos/rollout_corr.py)
    token_versions: Optional[torch.Tensor] = None       # [N, R] int64 policy version that sampled each token
    routes: Optional[torch.Tensor] = None               # [N, P+R, S, k] int16 MoE expert ids per sparse layer
    aborted: Optional[torch.Tensor] = None              # [N] bool: group aborted by over-sampling (rollout/abort.py)
    # Python-side per-row data (not tensors).
    response_texts: list = field(default_factory=list)
    ground_truths: list = field(default_factory=list)
    data_sources: list = field(default_factory=list)
    extra_infos: list = field(default_factory=list)
    # Per row: its prompt's images (rlhf.data.multimodal.MultiModalInputs) or None; empty when no
    # row has images. A plain list, so select / concat (micro-batches, regrouping, exchanges) keep it
    # with its row; rlhf.data.multimodal.collate_multi_modal makes a forward's inputs from it.
    multi_modal: list = field(default_factory=list)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.responses.shape[1]

    def trajectory_lengths(self) -> torch.Tensor:
        """[N] response-side tokens in context: generated tokens and tool outputs (what
        ``max_response_length`` bounds)."""
        return self.attention_mask[:, -self.response_length:].sum(-1)

    def generated_lengths(self) -> torch.Tensor:
        """[N] tokens the policy generated (the loss tokens); ``<= trajectory_lengths()``."""
        return self.response_mask.sum(-1)

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        """Rows `idx` of every per-row field (tensors and lists)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = None  # read on the host only when there are per-row lists
        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                kw[f.name] = v[idx_t.to(v.device)]
            elif isinstance(v, list) and v:
                idx_l = idx_t.tolist() if idx_l is None else idx_l
                kw[f.name] = [v[i] for i in idx_l]
            else:
                kw[f.name] = v
        return RolloutBatch(**kw)

    @staticmethod
    def concat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        kw = {}
        for f in dataclasses.fields(RolloutBatch):
            vals = [getattr(p, f.name) for p in parts]
            if all(isinstance(v, torch.Tensor) for v in vals):
                width = max(v.shape[1] for v in vals) if vals[0].dim() > 1 else None
                if width is not None and any(v.shape[1] != width for v in vals):
                    raise ValueError(f"cannot concat field {f.name} of different widths")
                kw[f.name] = torch.cat(vals)
            elif f.name == "multi_modal" and any(vals):  # text-only parts hold [] for their rows' None
                kw[f.name] = [x for p, v in zip(parts, vals) for x in (v or [None] * len(p))]
            elif all(isinstance(v, list) for v in vals):
                kw[f.name] = [x for v in vals for x in v]
            else:
                kw[f.name] = None
        return RolloutBatch(**kw)

    def to(self, device: torch.device) -> "RolloutBatch":
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, v.to(device))
        return self


def split_rows(n_rows: int, size: int) -> Iterator[torch.Tensor]:
    """Consecutive chunks of row indices of at most `size`."""
    for start in range(0, n_rows, size):
        yield torch.arange(start, min(start + size, n_rows))


def minibatch_major_shard(items: list, dp_rank: int, dp_size: int, mini_batch_size: int) -> list:
    """This rank's items when a global batch is cut into mini-batches first, then over dp.

    Rank r gets the r-th 1/dp of every mini-batch, in order, so its k-th local mini-batch
    is part of the global k-th mini-batch on every layout: the sequence of optimizer
    steps is the same on 1 rank and on N ranks.
    """
    if len(items) % mini_batch_size or mini_batch_size % dp_size:
        raise ValueError(f"batch of {len(items)} does not split into mini-batches of {mini_batch_size} "
                         f"over {dp_size} dp ranks")
    per_rank = mini_batch_size // dp_size
    out = []
    for start in range(0, len(items), mini_batch_size):
        lo = start + dp_rank * per_rank
        out.extend(items[lo:lo + per_rank])
    return out
