"""Prefix-grouped packed rows: a GRPO group's shared prompt is forwarded once.

The ``n`` responses of a GRPO group repeat one prompt. The padding-free pass
(:mod:`rlhf.models.packed`) packs every row ``[prompt | response]`` whole, so the prompt's
projections, MLPs and attention run ``n`` times. Here the rows of a micro-batch whose prompt
columns are identical (same real tokens at the same columns) form a group, and the packed row is

    [prompt_0 | prompt_1 | ... | prompt_{G-1} | response_0 | response_1 | ... | response_{B-1}]

(each prompt once, then every row's real response tokens). Attention is a cascade
(Hydragen / FlashInfer's shared-prefix attention, PrefixGrouper): a prompt token attends
causally inside its prompt, and a response token of row ``b`` (group ``g``) attends to
``[K/V of prompt_g ; K/V of its own response up to itself]``. Position ids of a response
continue from its prompt's length (``cumsum(attention_mask) - 1`` of the padded row), so every
token sees exactly the keys, values and rotary positions of the ungrouped pass: log-probs are
equal up to fp32 rounding, and the gradient through a shared prompt token is the sum over the
group's responses, accumulated once (the same sum the ungrouped pass forms over ``n`` copies).

Attention back ends (:func:`prefix_attention`): the prompts are plain packed sequences
(:func:`rlhf.models.varlen_attention.varlen_attention_forward`); the responses are a varlen
*cross* attention with ``cu_seqlens_q`` over the responses and ``cu_seqlens_k`` over their
``[prompt ; response]`` key lists, causal aligned bottom-right - flash-attn's varlen convention
on GPU, through whichever kernel :mod:`rlhf.models.attention_backend` picks for the site (flash-attn,
torch's ``varlen_attn``, compiled flex; or an injected kernel), bucketed SDPA with an explicit mask otherwise.

``auto`` (:func:`should_group`) groups a micro-batch when the prompt tokens it removes are at
least ``AUTO_MIN_SAVED_FRACTION`` (15%) of its real tokens and at least ``AUTO_MIN_SAVED_TOKENS`` (64);
on an accelerator without a varlen kernel (none of those: bucketed SDPA) also only when ``saved x hidden_size^2``
reaches ``AUTO_GPU_MIN_SAVED_WORK`` (there small passes are host-bound and grouping makes them slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from rlhf.models.varlen_attention import (DEFAULT_BUCKET_RATIO, VarlenPlan, _sdpa, build_varlen_plan,
                                          varlen_attention_forward, varlen_kernel)
from rlhf.schema.config import ConfigError

__all__ = ["AUTO_MIN_SAVED_FRACTION", "AUTO_MIN_SAVED_TOKENS", "AUTO_GPU_MIN_SAVED_WORK", "PrefixPlan", "GroupedRow",
           "group_by_prompt", "shared_prompt_tokens", "should_group", "prefix_attention", "resolve_mode"]

# auto: group when the shared prompts remove >= 15% of the micro-batch's real tokens and >= 64 tokens.
# bench/prefix_grouping.py (1 CPU thread, tiny model, n = 8): removing 3.5% of the tokens (prompt 4,
# response 128) is break-even (0.96x log-prob pass, 1.03x update), 22% (prompt 16-32, response
# 64-128) already gains 1.08-1.22x, the quickstart's shape (prompt 12, response 8) 1.9x.
AUTO_MIN_SAVED_FRACTION = 0.15
AUTO_MIN_SAVED_TOKENS = 64
# auto on an accelerator without a varlen kernel (CUDA without flash-attn: bucketed SDPA, one masked SDPA per
# response bucket per layer, plus the host-built plan): the grouped pass adds a roughly fixed host cost per
# layer, the work it removes per layer is ~ saved tokens x hidden^2 (the projections and MLP of the repeated
# prompt). bench/prefix_grouping.py on an H200, bf16, n = 8 (docs/benchmarks.md, "Prefix-grouped passes on
# the GPU"): saved x hidden^2 = 1.7e10 was slower (0.83-0.94x at hidden 1536, 0.68-0.83x at 3072), 3.0e10
# faster (1.12-1.23x at hidden 2048, 4 or 8 layers), 6.8e10 1.66-1.81x; the layer count did not move the
# ratio. fp32 pays from ~7.5e9 (1.5-2.6x), but the compute dtype is not known here (FSDP keeps fp32 master
# weights under bf16 compute), so the bf16 threshold holds for both: fp32 loses some gain, never gets slower.
# With a varlen kernel (flash-attn, torch's varlen_attn, compiled flex: both parts are then single varlen calls,
# no host-built plan) the token rules alone apply; unmeasured on a GPU yet (bench/prefix_grouping.py on the
# next lease, docs/howto/gpu-attention.md).
AUTO_GPU_MIN_SAVED_WORK = 2.5e10


@dataclass
class PrefixPlan:
    """What :func:`prefix_attention` needs; rows ``[0, n_prompt)`` of the packed row are the prompts.

    Attributes:
        n_prompt: ``Tp``, number of prompt tokens (all groups).
        prompt_cu: ``[G+1]`` int32 boundaries of the prompts inside ``[0, Tp)``; ``prompt_max`` the longest.
        resp_cu: ``[S+1]`` int32 boundaries of the non-empty responses inside ``[Tp, T)`` (relative to Tp).
        key_index: ``[Tk]`` int64 packed rows of each response's keys: its prompt's rows, then its own.
        key_cu: ``[S+1]`` int32 boundaries of those key lists; ``resp_max`` / ``key_max`` the longest.
        sdpa_args: what :meth:`sdpa_plan` builds the bucketed-SDPA plan from, host copies (on first use: a
            varlen kernel needs none of it).
    """

    n_prompt: int
    prompt_cu: torch.Tensor
    prompt_max: int
    resp_cu: torch.Tensor
    resp_max: int
    key_index: torch.Tensor
    key_cu: torch.Tensor
    key_max: int
    sdpa_args: tuple
    _sdpa: Optional[tuple] = None

    def sdpa_plan(self) -> tuple[VarlenPlan, list, torch.Tensor]:
        """The prompts' :class:`VarlenPlan`; per bucket of responses ``(q_rows [n_b*Lq], k_rows [n_b*Lk],
        key_pos [n_b, 1, Lq]`` (the last key index each query may see), ``valid [n_b*Lq], (n_b, Lq, Lk))``;
        and the ``[Tr]`` inverse that restores the response order. Built once per forward."""
        if self._sdpa is None:
            q_starts, q_lens, k_lens, k_prompt, ratio, key_index, key_cu, prompt_cu = self.sdpa_args  # host copies
            dev = self.key_index.device
            buckets, inverse = _response_buckets(q_starts, q_lens, key_cu.tolist(), k_lens, k_prompt, key_index,
                                                 self.n_prompt, ratio, dev)
            self._sdpa = (build_varlen_plan(prompt_cu, ratio, device=dev), buckets, inverse)
        return self._sdpa

    def attend(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float], dropout: float, sliding_window: Optional[int],
               softcap: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`prefix_attention` on this plan (the varlen attention function's seam)."""
        return prefix_attention(module, query, key, value, self, scaling, dropout, sliding_window, softcap, sinks)


@dataclass
class GroupedRow:
    """A prefix-grouped packed row (the :class:`rlhf.data.packing.PackedBatch` fields the model call uses).

    Attributes:
        input_ids, position_ids: ``[1, T]``; ``T = Tp + sum of response tokens``.
        inverse: ``[B*L]`` int64 packed row of each padded position (``-1`` at pads); the prompt
            columns of every row of a group map to the group's one prompt copy.
        plan: the attention plan, passed to the model as the ``prefix_plan`` keyword.
        saved: prompt tokens not forwarded again (``sum_b P_b - sum_g P_g``); ``total`` = T.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    inverse: torch.Tensor
    plan: PrefixPlan
    saved: int

    @property
    def total(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict:
        return {"prefix_plan": self.plan}


def _group_ids(input_ids: torch.Tensor, mask: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group index ``[B]`` (order of first appearance) and each group's first row ``[G]``."""
    key = input_ids[:, :P].masked_fill(~mask[:, :P], -1)  # pads differ from every token id
    _, inv = torch.unique(key, dim=0, return_inverse=True)  # [B], sorted-key order
    B = input_ids.shape[0]
    first = torch.full((int(inv.max()) + 1 if B else 0,), B, dtype=torch.int64, device=inv.device)
    first = first.scatter_reduce(0, inv, torch.arange(B, device=inv.device), reduce="amin")
    order = torch.argsort(first)  # groups in order of their first row
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank[inv], first[order]


def group_by_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, *,
                    bucket_ratio: float = DEFAULT_BUCKET_RATIO) -> GroupedRow:
    """Build the prefix-grouped packed row of ``input_ids [B, L]`` (left-padded prompt of ``P = L - R``
    columns, right-padded response of ``R``); ``bucket_ratio``: as :func:`build_varlen_plan`."""
    B, L = input_ids.shape
    P = L - int(response_length)
    dev = input_ids.device
    # Index arithmetic over a [B, L] batch, done on the host and moved once: on a GPU, torch.unique over
    # rows and the per-row reads below were 2.6x the host time of the pass they shorten (H200 profile,
    # docs/benchmarks.md).
    input_ids, mask = input_ids.cpu(), attention_mask.bool().cpu()
    group, reps = _group_ids(input_ids, mask, P)  # [B], [G]
    pmask = mask[:, :P]
    p_len = pmask.sum(-1)  # [B]
    g_len = p_len[reps]  # [G]
    g_start = torch.cumsum(g_len, 0) - g_len  # [G]
    Tp = int(g_len.sum())
    rmask = mask[:, P:]
    r_len = rmask.sum(-1)  # [B]
    # Packed row of every real padded position: prompt columns -> their group's copy, response -> own.
    inverse = torch.full((B, L), -1, dtype=torch.int64)
    p_rank = torch.cumsum(pmask.long(), -1) - 1
    inverse[:, :P] = torch.where(pmask, g_start[group][:, None] + p_rank, -1)
    r_rows = Tp + torch.cumsum(rmask.flatten().long(), 0).view(B, -1) - 1
    inverse[:, P:] = torch.where(rmask, r_rows, -1)
    flat_pos = (torch.cumsum(mask.long(), -1) - 1).flatten()
    prompt_src = torch.nonzero(pmask[reps].flatten(), as_tuple=False).flatten()  # [Tp] in [G*P]
    prompt_src = reps.repeat_interleave(P)[prompt_src] * L + prompt_src % P  # -> [B*L] indices
    resp_src = torch.nonzero(mask.flatten() & (torch.arange(L) >= P).repeat(B), as_tuple=False).flatten()
    src = torch.cat([prompt_src, resp_src])  # [T]
    ids = input_ids.flatten()[src][None].to(dev)
    pos = flat_pos[src][None].to(dev)

    # Attention plan (host side: the boundaries are small).
    g_len_l, g_start_l, group_l = g_len.tolist(), g_start.tolist(), group.tolist()
    r_len_l = r_len.tolist()
    keys, key_lens, q_lens, q_starts, kp = [], [], [], [], []
    off = Tp
    for b in range(B):
        if r_len_l[b] == 0:
            continue
        g = group_l[b]
        keys.append(torch.arange(g_start_l[g], g_start_l[g] + g_len_l[g]))
        keys.append(torch.arange(off, off + r_len_l[b]))
        q_starts.append(off - Tp)
        q_lens.append(r_len_l[b])
        key_lens.append(g_len_l[g] + r_len_l[b])
        kp.append(g_len_l[g])
        off += r_len_l[b]
    key_index = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
    resp_cu = _cu(q_lens)
    key_cu = _cu(key_lens)
    prompt_cu = _cu(g_len_l)
    plan = PrefixPlan(n_prompt=Tp, prompt_cu=prompt_cu.to(dev), prompt_max=max(g_len_l, default=0),
                      resp_cu=resp_cu.to(dev), resp_max=max(q_lens, default=0), key_index=key_index.to(dev),
                      key_cu=key_cu.to(dev), key_max=max(key_lens, default=0),
                      sdpa_args=(q_starts, q_lens, key_lens, kp, bucket_ratio, key_index, key_cu, prompt_cu))
    saved = int(p_len.sum()) - Tp
    return GroupedRow(input_ids=ids, position_ids=pos, inverse=inverse.flatten().to(dev), plan=plan, saved=saved)


def _cu(lens: list) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    return cu


def _response_buckets(q_starts: list, q_lens: list, k_starts: list, k_lens: list, k_prompt: list,
                      key_index: torch.Tensor, Tp: int, ratio: float, dev: torch.device) -> tuple[list, torch.Tensor]:
    """SDPA buckets of responses with similar key lengths (as :func:`build_varlen_plan`): queries and
    keys right-padded (pads repeat the last row; pad queries are dropped, real queries never see pad keys)."""
    order = sorted(range(len(q_lens)), key=lambda j: -k_lens[j])
    buckets, real = [], []
    i = 0
    while i < len(order):
        longest = k_lens[order[i]]
        j = i
        while j < len(order) and k_lens[order[j]] >= ratio * longest:
            j += 1
        m = order[i:j]
        lq = max(q_lens[x] for x in m)
        qs, ql = torch.tensor([q_starts[x] for x in m]), torch.tensor([q_lens[x] for x in m])
        ks, kl = torch.tensor([k_starts[x] for x in m]), torch.tensor([k_lens[x] for x in m])
        oq, ok = torch.arange(lq), torch.arange(longest)
        valid = oq[None, :] < ql[:, None]  # [n_b, Lq]
        q_rows = Tp + qs[:, None] + torch.minimum(oq[None, :], ql[:, None] - 1)
        k_rows = key_index[ks[:, None] + torch.minimum(ok[None, :], kl[:, None] - 1)]
        key_pos = torch.tensor([k_prompt[x] for x in m])[:, None] + oq[None, :]  # [n_b, Lq] last visible key
        buckets.append((q_rows.flatten().to(dev), k_rows.flatten().to(dev), key_pos[:, None].to(dev),
                        valid.flatten().to(dev), (len(m), lq, longest)))
        real.append((qs[:, None] + torch.minimum(oq[None, :], ql[:, None] - 1))[valid])
        i = j
    n = sum(q_lens)
    inverse = torch.empty(n, dtype=torch.int64)
    if real:
        inverse[torch.cat(real)] = torch.arange(n)
    return buckets, inverse.to(dev)


def resolve_mode(mode: Any, *, use_remove_padding: bool, sp: int = 1, tp: int = 1, pp: int = 1, vlm: bool = False,
                 moe: bool = False) -> bool | str:
    """``model.prefix_grouping`` for this layout and model: ``"auto"`` becomes False where grouping is
    not supported; ``True`` there is a :class:`ConfigError` naming the reason."""
    why = ("needs model.use_remove_padding=true (it is a padding-free layout)" if not use_remove_padding else
           f"is not supported with parallel.sp={sp} (Ulysses splits the packed row by position)" if sp > 1 else
           f"is not supported with parallel.tp={tp} in this version" if tp > 1 else
           f"is not supported with parallel.pp={pp}" if pp > 1 else
           "is not supported for a vision-language model (M-RoPE positions)" if vlm else
           "is not supported for a MoE model (router replay and routing stats count the packed tokens)" if moe else
           None)
    if why is None or mode is False:
        return mode
    if mode is True:
        raise ConfigError(f"model.prefix_grouping=true {why}; set model.prefix_grouping=auto or false")
    return False


def shared_prompt_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> int:
    """Prompt tokens a grouped row would not forward again (``sum_b P_b - sum_g P_g``), without building it."""
    P = input_ids.shape[1] - int(response_length)
    input_ids, mask = input_ids.cpu(), attention_mask.bool().cpu()  # host arithmetic, as group_by_prompt
    _, reps = _group_ids(input_ids, mask, P)
    p_len = mask[:, :P].sum(-1)
    return int(p_len.sum() - p_len[reps].sum())


def should_group(mode: Any, saved: int, total: int, *, device_type: str = "cpu", varlen_kernel: bool = False,
                 hidden_size: int = 0) -> bool:
    """``model.prefix_grouping``: True / False as given; ``"auto"``: group when the ``saved`` prompt tokens
    are at least ``AUTO_MIN_SAVED_FRACTION`` of the ungrouped row's ``total`` and ``AUTO_MIN_SAVED_TOKENS``,
    and, on a non-CPU ``device_type`` without a ``varlen_kernel`` (flash-attn, torch varlen, flex), when
    ``saved * hidden_size**2`` (the model's hidden size; 0 = unknown, never) is at least ``AUTO_GPU_MIN_SAVED_WORK``."""
    if mode != "auto":
        return bool(mode)
    if saved < AUTO_MIN_SAVED_TOKENS or saved < AUTO_MIN_SAVED_FRACTION * total:
        return False
    if device_type == "cpu" or varlen_kernel:  # CPU: pays from ~4% removed; a varlen kernel: unmeasured, as before
        return True
    return saved * hidden_size ** 2 >= AUTO_GPU_MIN_SAVED_WORK


def prefix_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     plan: PrefixPlan, scaling: Optional[float], dropout: float, sliding_window: Optional[int],
                     softcap: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cascade attention over a prefix-grouped row: ``query [1, H, T, D]``, ``key / value [1, Hkv, T, D]``
    -> ``[1, T, H, D]``. Prompts: causal packed self-attention; responses: varlen attention over
    ``[prompt keys ; own keys]``, causal aligned bottom-right (+ sliding window / soft-cap as the model says)."""
    Tp = plan.n_prompt
    cap = {"softcap": softcap} if softcap is not None else {}
    if sinks is not None:  # GPT-OSS: flash-attn has no sinks; both parts take the explicit path (no kernel)
        cap["s_aux"] = sinks
    kernel = varlen_kernel(query.device, query.dtype, softcap=softcap is not None,
                           dropout=bool(dropout)) if sinks is None else None
    prompt_plan, buckets, resp_inverse = plan.sdpa_plan() if kernel is None else (None, [], None)
    out_p = query.new_zeros(1, 0, query.shape[1], value.shape[-1])  # no prompt tokens at all (all empty)
    if Tp > 0:
        out_p, _ = varlen_attention_forward(module, query[:, :, :Tp], key[:, :, :Tp], value[:, :, :Tp], None,
                                            scaling=scaling, dropout=dropout, sliding_window=sliding_window,
                                            cu_seq_lens_q=plan.prompt_cu, cu_seq_lens_k=plan.prompt_cu,
                                            max_length_q=plan.prompt_max, max_length_k=plan.prompt_max,
                                            varlen_plan=prompt_plan, **cap)  # [1, Tp, H, D]
    if query.shape[2] == Tp:
        return out_p
    q = query[0, :, Tp:]  # [H, Tr, D]
    k, v = key[0], value[0]  # [Hkv, T, D]
    if kernel is not None:
        ki = plan.key_index
        out_r = kernel(q.transpose(0, 1), k.index_select(1, ki).transpose(0, 1), v.index_select(1, ki).transpose(0, 1),
                       cu_seqlens_q=plan.resp_cu, cu_seqlens_k=plan.key_cu, max_seqlen_q=plan.resp_max,
                       max_seqlen_k=plan.key_max, dropout_p=dropout, softmax_scale=scaling, causal=True,
                       window_size=(sliding_window - 1, 0) if sliding_window is not None else (-1, -1), **cap)
        return torch.cat([out_p, out_r.unsqueeze(0)], dim=1)
    H, D = q.shape[0], q.shape[-1]
    outs = []
    for q_rows, k_rows, key_pos, valid, (n_b, lq, lk) in buckets:
        qb = query[0].index_select(1, q_rows).view(H, n_b, lq, D).transpose(0, 1)  # [n_b, H, Lq, D]
        kb = k.index_select(1, k_rows).view(k.shape[0], n_b, lk, D).transpose(0, 1)  # [n_b, Hkv, Lk, D]
        vb = v.index_select(1, k_rows).view(v.shape[0], n_b, lk, v.shape[-1]).transpose(0, 1)
        kk = torch.arange(lk, device=q.device)
        allowed = kk <= key_pos[..., None]  # [n_b, 1, Lq, Lk]
        if sliding_window is not None:
            allowed = allowed & (kk > key_pos[..., None] - sliding_window)
        ob = _sdpa(qb, kb, vb, allowed, scaling, dropout, softcap, sinks)  # [n_b, H, Lq, Dv]
        outs.append(ob.transpose(1, 2).reshape(n_b * lq, H, ob.shape[-1])[valid])
    out_r = torch.cat(outs, dim=0)[resp_inverse]  # [Tr, H, Dv]
    return torch.cat([out_p, out_r.unsqueeze(0)], dim=1)
