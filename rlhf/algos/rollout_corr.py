"""Decoupled-mode rollout correction: importance weights, rejection sampling and the token veto
(verl's ``algorithm.rollout_correction``, ``verl/trainer/ppo/rollout_corr_helper.py``), and
AReaL's decoupled-PPO behaviour weight.

Three policies: ``pi_rollout`` (the sampler that produced the tokens; ``rollout_log_probs``),
``pi_old`` (the training-layout recomputation at the start of the step, AReaL's *proximal*
policy; ``old_log_probs``) and ``pi_theta`` (being trained).  Everything here is a function of
the per-token log ratio ``lr_t = log pi_old(y_t) - log pi_rollout(y_t)`` (``[B, T]``) and the
response mask ``m`` (``[B, T]``, holes allowed); ``rho_t = exp(lr_t)``.

* **IS weights** (``actor.rollout_is``, ``rollout_is_threshold`` = C, ``rollout_is_batch_normalize``;
  Yao et al. 2025 TIS, verl ``compute_rollout_correction_weights``):
  token ``w_t = min(exp(clip(lr_t, +-20)), C) m_t``; sequence
  ``w_i = min(exp(clip(sum_t m_t lr_t, +-20)), C)`` broadcast over the row.  Batch-normalised:
  ``w / mean(w)``, the mean over all valid tokens (token) or over sequences with a token
  (sequence), **global over ranks** (``global_sum``).  The weights multiply the per-token policy loss.
* **Rejection sampling** (``actor.rollout_rs``, ``rollout_rs_threshold``; verl
  ``compute_rollout_rejection_mask``): the comma-separated options below, all of which must pass.
  ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = exp(lr) - 1 - lr`` (``lr`` clipped to +-20); ``token_*``
  per token, ``seq_sum_* / seq_mean_* / seq_max_*`` per sequence (a rejected sequence loses every
  token).  ``*_k1`` thresholds are ratio bounds ``"lower_upper"`` (one number ``u`` means
  ``1/u _ u``) tested as ``log(lower) <= k1 <= log(upper)``; k2 / k3 take an upper bound.
  ``seq_mean_k1`` is the geometric-mean filter (Geo-RS).  verl's earlier names are kept:
  ``token`` / ``sequence`` / ``geometric`` test ``rho_t``, ``exp(sum lr)``, ``exp(mean lr)`` against
  ``[rollout_rs_threshold_lower (default 1/upper), rollout_rs_threshold]``.
  **IcePop** (Ring-1T, 2025: drop tokens whose ``rho`` leaves ``[alpha, beta] = [0.5, 5]``) is
  ``rollout_rs: token`` with thresholds 5 / 0.5, or ``token_k1`` with ``"0.2_2.0"``.
* **Token veto** (``actor.rollout_token_veto_threshold`` = v): a sequence with any valid token
  whose ``rho_t < v`` is rejected whole.
* **Decoupled PPO** (AReaL, Fu et al. 2025 eq. 5; ``actor.use_decoupled_loss``,
  ``behav_imp_weight_cap``): the PPO loss clips ``pi_theta / pi_old`` and is weighted per token by
  ``pi_old / pi_rollout``; tokens whose weight exceeds the cap get weight 0 (they stay in the
  normaliser, as AReaL).  With ``pi_old == pi_rollout`` every weight is exactly 1: plain PPO.

Rejection changes the response mask (so rejected tokens leave the loss normaliser, as verl).
All statistics take ``global_sum`` / ``global_max`` (identity on one rank; the trainer passes dp
all-reduces) so that they do not depend on the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["SAFETY_BOUND", "RS_OPTIONS", "LEGACY_RS_OPTIONS", "parse_rollout_rs", "parse_rs_thresholds",
           "is_weights", "rejection_mask", "token_veto_mask", "decoupled_behav_weights", "mismatch_metrics"]

SAFETY_BOUND = 20.0  # verl's bound on log ratios before exp (exp(20) ~ 4.9e8)
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LEGACY_RS_OPTIONS = ("token", "sequence", "geometric")
IS_LEVELS = ("token", "sequence")

GlobalReduce = Callable[[torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t


def _row_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum(-1)


def _row_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # verl's masked_mean: sum / (count + 1e-8), so an empty row gives 0.
    return (x * m).sum(-1) / (m.sum(-1) + 1e-8)


def parse_rollout_rs(rollout_rs: str) -> list[str]:
    """Validated, de-duplicated options of ``actor.rollout_rs`` (comma separated); ``[]`` when off."""
    opts = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    legacy = [o for o in opts if o in LEGACY_RS_OPTIONS]
    bad = [o for o in opts if o not in RS_OPTIONS and o not in LEGACY_RS_OPTIONS]
    if bad:
        raise ValueError(f"actor.rollout_rs: unknown option {bad[0]!r}; valid: {', '.join(RS_OPTIONS + LEGACY_RS_OPTIONS)}")
    if legacy and len(opts) > 1:
        raise ValueError(f"actor.rollout_rs: {legacy[0]!r} (verl's earlier mode name) cannot be combined with "
                         f"other options; use the k1/k2/k3 options to chain criteria")
    return opts


def parse_rs_thresholds(options: list[str], spec: str | float) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}`` from ``actor.rollout_rs_threshold`` (verl's format): one entry
    for all options or one per option, comma separated; k1 options take ``"lower_upper"`` or one
    upper ``u`` (lower ``1/u``); other options one positive upper bound (lower ``None``)."""
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not specs:
        raise ValueError("actor.rollout_rs_threshold: must be set when actor.rollout_rs is")
    if len(specs) not in (1, len(options)):
        raise ValueError(f"actor.rollout_rs_threshold: expected 1 or {len(options)} comma-separated thresholds "
                         f"(one per rollout_rs option), got {len(specs)}")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for opt, s in zip(options, specs):
        try:
            if opt.endswith("k1"):
                lo, hi = (float(p) for p in s.split("_", 1)) if "_" in s else (1.0 / float(s), float(s))
            elif "_" in s:
                raise ValueError(f"actor.rollout_rs_threshold: {s!r} for {opt}: one upper bound, no '_'")
            else:
                lo, hi = None, float(s)
        except ValueError as exc:
            if "rollout_rs_threshold" in str(exc):
                raise
            raise ValueError(f"actor.rollout_rs_threshold: {s!r} for {opt} is not a number") from exc
        if hi <= 0 or (lo is not None and lo <= 0):
            raise ValueError(f"actor.rollout_rs_threshold: must be positive for {opt}, got {s!r}")
        out[opt] = (lo, hi)
    return out


@torch.no_grad()
def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
               batch_normalize: bool = False, global_sum: GlobalReduce = _local) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS weights ``[B, T]`` (0 on holes) and the batch-norm factor (1 when off).

    ``log_ratio = old_log_probs - rollout_log_probs``; see the module docstring for the formulas.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"actor.rollout_is must be one of {IS_LEVELS} here, got {level!r}")
    if threshold <= 0:
        raise ValueError(f"actor.rollout_is_threshold must be > 0, got {threshold}")
    m = mask.to(log_ratio.dtype)
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        w = torch.exp(_row_sum(log_ratio, m).clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio)
    w = (w * m).clamp(max=threshold)
    factor = torch.ones((), dtype=w.dtype, device=w.device)
    if batch_normalize:
        if level == "token":
            s = global_sum(torch.stack([(w * m).sum(), m.sum()]))
        else:
            rows = (m.sum(-1) > 0).to(w.dtype)
            s = global_sum(torch.stack([(_row_mean(w, m) * rows).sum(), rows.sum()]))
        mean = s[0] / s[1]
        if mean > 1e-8:
            w, factor = w / mean, mean
    return w, factor


@torch.no_grad()
def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: str | float,
                   threshold_lower: float | None = None) -> torch.Tensor:
    """Keep-mask ``[B, T]`` (1 keep, 0 reject; holes stay as in ``mask``) of ``actor.rollout_rs``.

    ``threshold_lower`` is used by the earlier ``token`` / ``sequence`` / ``geometric`` modes only.
    """
    opts = parse_rollout_rs(rollout_rs)
    m = mask.to(log_ratio.dtype)
    if not opts:
        return m
    if opts[0] in LEGACY_RS_OPTIONS:
        upper = float(threshold)
        lower = threshold_lower if threshold_lower is not None and threshold_lower > 0 else 1.0 / upper
        if opts[0] == "token":
            stat = log_ratio
        else:
            agg = _row_sum(log_ratio, m) if opts[0] == "sequence" else _row_mean(log_ratio, m)
            stat = agg.unsqueeze(-1).expand_as(log_ratio)
        rho = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        return m * ((rho >= lower) & (rho <= upper)).to(m.dtype)
    bounds = parse_rs_thresholds(opts, threshold)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ks = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(m, dtype=torch.bool)
    for opt in opts:
        lo, hi = bounds[opt]
        k = ks[opt[-2:]]
        if opt.startswith("token"):
            stat = k
        elif opt.startswith("seq_sum"):
            stat = _row_sum(k, m).unsqueeze(-1)
        elif opt.startswith("seq_mean"):
            stat = _row_mean(k, m).unsqueeze(-1)
        else:  # seq_max: the largest token divergence of the row (0 for an empty row, as verl)
            mx = k.masked_fill(m == 0, float("-inf")).amax(-1)
            stat = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1)
        ok = (stat >= math.log(lo)) & (stat <= math.log(hi)) if opt.endswith("k1") else stat <= hi
        keep = keep & ok.expand_as(keep)
    return m * keep.to(m.dtype)


@torch.no_grad()
def token_veto_mask(log_ratio: torch.Tensor, mask: torch.Tensor, veto_threshold: float) -> torch.Tensor:
    """Keep-mask ``[B, T]``: rows holding a valid token with ``rho_t < veto_threshold`` are zeroed."""
    if veto_threshold <= 0:
        raise ValueError(f"actor.rollout_token_veto_threshold must be > 0, got {veto_threshold}")
    m = mask.to(log_ratio.dtype)
    bad = ((log_ratio < math.log(veto_threshold)) & (m > 0)).any(-1, keepdim=True)
    return m * (~bad).to(m.dtype)


@torch.no_grad()
def decoupled_behav_weights(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                            cap: float | None) -> torch.Tensor:
    """AReaL's behaviour weight ``[B, T]``: ``exp(l_prox - l_behav)`` on valid tokens, 0 where it
    exceeds ``cap`` (``None`` or ``<= 0``: no cap) and on holes."""
    w = torch.exp(proximal_log_probs - behaviour_log_probs)
    keep = mask > 0
    if cap is not None and cap > 0:
        keep = keep & (w <= cap)
    return torch.where(keep, w, torch.zeros_like(w))


@torch.no_grad()
def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, *,
                     weights: torch.Tensor | None = None, kept: torch.Tensor | None = None,
                     global_sum: GlobalReduce = _local, global_max: GlobalReduce = _local) -> dict[str, torch.Tensor]:
    """Training/rollout mismatch diagnostics, global over ranks (verl's ``compute_offpolicy_metrics``).

    ``mismatch/kl = mean_t(l_roll - l_old)``, ``mismatch/k3_kl = mean_t(rho - 1 - log rho)``,
    ``mismatch/ppl_ratio = mean_i exp(mean_t l_roll - mean_t l_old)`` (training PPL over rollout
    PPL per sequence), ``mismatch/training_ppl``, ``mismatch/rollout_ppl``,
    ``mismatch/chi2_token = mean_t rho^2 - 1``; token means over all valid tokens of all ranks,
    sequence means over the sequences with a valid token (verl also counts empty rows, which do
    not occur there).  With ``weights`` (the per-token loss weights applied):
    ``mismatch/is_weight_{mean,max,min}`` over valid tokens.  With ``kept`` (the mask after
    rejection): ``mismatch/rejected_frac`` (tokens) and ``mismatch/rejected_seq_frac``.
    """
    m = mask.to(old_log_probs.dtype)
    lr = old_log_probs - rollout_log_probs
    rows = (m.sum(-1) > 0).to(m.dtype)
    mean_old, mean_roll = _row_mean(old_log_probs, m), _row_mean(rollout_log_probs, m)
    rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    parts = [m.sum(), rows.sum(), (-lr * m).sum(), ((torch.exp(lr) - lr - 1) * m).sum(),
             (torch.exp(mean_roll - mean_old) * rows).sum(), (torch.exp(-mean_old) * rows).sum(),
             (torch.exp(-mean_roll) * rows).sum(), (rho.square() * m).sum()]
    if weights is not None:
        parts.append((weights * m).sum())
    if kept is not None:
        parts.append(((1 - kept) * m).sum())
        parts.append((((kept < m).any(-1)).to(m.dtype) * rows).sum())
    s = global_sum(torch.stack(parts).double())
    n_tok, n_seq = s[0].clamp(min=1), s[1].clamp(min=1)
    out = {"mismatch/kl": s[2] / n_tok, "mismatch/k3_kl": s[3] / n_tok, "mismatch/ppl_ratio": s[4] / n_seq,
           "mismatch/training_ppl": s[5] / n_seq, "mismatch/rollout_ppl": s[6] / n_seq,
           "mismatch/chi2_token": s[7] / n_tok - 1.0}
    i = 8
    if weights is not None:
        out["mismatch/is_weight_mean"] = s[i] / n_tok
        i += 1
        hi = weights.masked_fill(m == 0, float("-inf")).amax() if m.numel() else weights.new_tensor(float("-inf"))
        lo = weights.masked_fill(m == 0, float("inf")).amin() if m.numel() else weights.new_tensor(float("inf"))
        mx = global_max(torch.stack([hi, -lo]).double())
        out["mismatch/is_weight_max"], out["mismatch/is_weight_min"] = mx[0], -mx[1]
    if kept is not None:
        out["mismatch/rejected_frac"] = s[i] / n_tok
        out["mismatch/rejected_seq_frac"] = s[i + 1] / n_seq
    return {k: v.float() for k, v in out.items()}
