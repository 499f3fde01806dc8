"""Evaluation metrics over sampled responses: pass@k, maj@k, lengths, truncation, per data_source.

Shared by ``python -m rlhf.eval`` and ``RLTrainer.validate``. Everything here is pure
(no distributed code): callers gather the per-sample :class:`SampleRecord` rows of all
ranks and call :func:`summarize`, so the numbers do not depend on the layout.

* ``pass@1`` is the mean correctness over all samples.
* ``pass@k`` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code", eq. 1): with ``n`` samples of which ``c`` are correct,
  ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over prompts.
* ``maj@k`` is majority voting: the ``n`` samples of a prompt are cut into ``n // k``
  disjoint groups of ``k`` (in sample order); in each group the most frequent extracted
  answer (``pred``, returned by the reward function; ties go to the earliest) wins and
  the group scores its correctness; a prompt scores the mean over its groups. Rewards
  that return no ``pred`` (e.g. ``gsm8k``) have no maj@k.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

ALL = "all"


@dataclass
class SampleRecord:
    """One scored response. ``key``: the prompt's dataset index; ``sample``: 0..n-1; ``extras``: the
    other numeric keys of the reward function's dict (those it reported for this sample)."""

    key: int
    sample: int
    data_source: str
    score: float
    acc: float
    pred: Optional[str]
    length: int
    truncated: bool
    extras: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021).

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which avoids huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def maj_at_k(preds: Sequence[Optional[str]], accs: Sequence[float], k: int) -> float:
    """Majority-vote accuracy of one prompt's samples (in sample order), groups of ``k``.

    A group without any extracted answer scores 0.
    """
    if not 1 <= k <= len(preds) or len(preds) != len(accs):
        raise ValueError(f"maj_at_k needs 1 <= k <= n and aligned inputs, got k={k}, {len(preds)} preds, "
                         f"{len(accs)} accs")
    groups = [range(s, s + k) for s in range(0, len(preds) - k + 1, k)]
    total = 0.0
    for g in groups:
        votes = Counter(preds[i] for i in g if preds[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        winner = next(i for i in g if preds[i] is not None and votes[preds[i]] == top)  # earliest on ties
        total += accs[winner]
    return total / len(groups)


def ks_for(n: int) -> list[int]:
    """Powers of two up to ``n``, and ``n`` itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def _summarize_group(records: list[SampleRecord]) -> dict[str, float]:
    by_prompt: dict[int, list[SampleRecord]] = defaultdict(list)
    for r in records:
        by_prompt[r.key].append(r)
    prompts = [sorted(rs, key=lambda r: r.sample) for rs in by_prompt.values()]
    n = min(len(p) for p in prompts)
    out = {"n_prompts": float(len(prompts)), "n_samples": float(len(records)),
           "score": sum(r.score for r in records) / len(records),
           "response_length": sum(r.length for r in records) / len(records),
           "truncation_rate": sum(r.truncated for r in records) / len(records),
           "pass@1": sum(r.acc for r in records) / len(records)}
    for key in sorted({k for r in records for k in r.extras}):
        reported = [r.extras[key] for r in records if key in r.extras]
        out[f"reward/{key}"] = sum(reported) / len(reported)
    has_pred = any(r.pred is not None for r in records)
    for k in ks_for(n):
        if k > 1:
            out[f"pass@{k}"] = sum(pass_at_k(len(p), sum(r.acc >= 0.5 for r in p), k) for p in prompts) / len(prompts)
        if has_pred:
            out[f"maj@{k}"] = sum(maj_at_k([r.pred for r in p], [r.acc for r in p], k) for p in prompts) / len(prompts)
    return out


def summarize(records: Iterable[SampleRecord]) -> dict[str, dict[str, float]]:
    """``{data_source: metrics, ..., "all": metrics}`` over every record (all ranks).

    Metrics: ``pass@1`` (mean acc), ``pass@k`` and ``maj@k`` for ``k`` in :func:`ks_for`
    of the smallest per-prompt sample count, ``score`` (mean reward), ``response_length``
    (mean tokens), ``truncation_rate``, ``n_prompts``, ``n_samples``, and ``reward/<key>`` for
    each extra key of the reward dict (mean over the samples that reported it). For pass@k a
    sample counts as correct when ``acc >= 0.5``.
    """
    records = list(records)
    if not records:
        return {}
    by_source: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in records:
        by_source[r.data_source].append(r)
    out = {src: _summarize_group(rs) for src, rs in sorted(by_source.items())}
    if len(by_source) > 1:
        # Keys are per data source; the same dataset index in two sources stays two prompts.
        ids = {src: i for i, src in enumerate(sorted(by_source))}
        stride = max(r.key for r in records) + 1
        out[ALL] = _summarize_group([SampleRecord(**{**r.to_dict(), "key": ids[r.data_source] * stride + r.key})
                                     for r in records])
    else:
        out[ALL] = next(iter(out.values()))
    return out


def records_from_scores(keys: Sequence[int], data_sources: Sequence[str], scores: Sequence[float],
                        accs: Sequence[float], preds: Sequence[Optional[str]], lengths: Sequence[int],
                        truncated: Sequence[bool], extras: Optional[Sequence[dict]] = None) -> list[SampleRecord]:
    """Records of ``B`` rows in prompt-major order (row ``i * n + j`` = sample ``j`` of prompt ``i``)."""
    seen: Counter = Counter()
    out = []
    for i, key in enumerate(keys):
        acc = accs[i]
        out.append(SampleRecord(key=int(key), sample=seen[key], data_source=data_sources[i], score=float(scores[i]),
                                acc=0.0 if acc is None or math.isnan(acc) else float(acc), pred=preds[i],
                                length=int(lengths[i]), truncated=bool(truncated[i]),
                                extras=dict(extras[i]) if extras is not None else {}))
        seen[key] += 1
    return out


def score_batch(scorer, batch) -> list[SampleRecord]:
    """Score a :class:`rlhf.schema.batch.RolloutBatch` with a scorer (:mod:`rlhf.rewards.pool`) and return its records.

    ``acc`` is the reward's ``"acc"`` when it returns one, else ``score >= 1`` (as in training).
    """
    res = scorer.score(batch.response_texts, batch.ground_truths, batch.data_sources, batch.extra_infos)
    scores = res.scores.tolist()
    accs = res.extra_metrics.get("acc") or [float(s >= 1.0) for s in scores]
    extras = [{k: v[i] for k, v in res.extra_metrics.items() if not math.isnan(v[i])} for i in range(len(scores))]
    return records_from_scores(batch.index.tolist(), batch.data_sources, scores, accs, res.preds or [None] * len(scores),
                               batch.trajectory_lengths().long().tolist(), batch.truncated.tolist(), extras)


def generation_rows(records: Sequence[SampleRecord], batch, prompt_text: dict[int, str], n: int,
                    group=None) -> list[dict]:
    """The first ``n`` samples over the ranks of ``group`` (first sample of each prompt in key order,
    then the second, ...), as ``{"key", "sample", "prompt", "response", "ground_truth", "score"}``
    rows; the same rows whatever the layout. Collective over ``group`` when ``n > 0``."""
    from rlhf.models.parallel import all_gather_object

    if n <= 0:
        return []
    local = sorted(({"key": r.key, "sample": r.sample, "prompt": prompt_text[r.key], "response": batch.response_texts[i],
                     "ground_truth": str(batch.ground_truths[i]), "score": r.score} for i, r in enumerate(records)),
                   key=lambda row: (row["sample"], row["key"]))[:n]  # a rank's first n are its only candidates
    rows = [row for piece in all_gather_object(local, group) for row in piece]
    return sorted(rows, key=lambda row: (row["sample"], row["key"]))[:n]


def rollout_rows(batch, scores: Sequence[float], extra_metrics: dict, examples, step: int) -> list[dict]:
    """verl's rollout dump (``trainer.rollout_data_dir``): one row per sample, ``input`` (the prompt
    text), ``output``, ``gts``, ``score`` (after reward shaping, before any KL penalty), ``step`` and
    the reward dict's numeric keys."""
    rows = []
    for i, key in enumerate(batch.index.tolist()):
        row = {"input": examples[key].prompt_text, "output": batch.response_texts[i],
               "gts": str(batch.ground_truths[i]), "score": float(scores[i]), "step": step}
        row.update({k: v[i] for k, v in extra_metrics.items() if v[i] == v[i]})  # NaN: not reported
        rows.append(row)
    return rows


def flat_metrics(summary: dict[str, dict[str, float]], prefix: str = "val") -> dict[str, float]:
    """``{prefix/source/metric: v}`` plus, from the ``all`` entry, ``prefix/acc``, ``/score``,
    ``/response_length``, ``/n`` (mean over every sample, as validation always logged), pass@k,
    maj@k, truncation_rate and the reward dict's extras ``prefix/reward/<key>``."""
    out: dict[str, float] = {}
    for src, metrics in summary.items():
        if src != ALL:
            out.update({f"{prefix}/{src}/{k}": v for k, v in metrics.items()})
    if ALL in summary:
        a = summary[ALL]
        out.update({f"{prefix}/acc": a["pass@1"], f"{prefix}/score": a["score"],
                    f"{prefix}/response_length": a["response_length"], f"{prefix}/n": a["n_samples"]})
        out.update({f"{prefix}/{k}": v for k, v in a.items() if k.startswith(("pass@", "maj@", "reward/"))
                    or k == "truncation_rate"})
    return out


def format_table(summary: dict[str, dict[str, float]]) -> str:
    """One line per data source (and ``all``) for the console."""
    lines = []
    for src, m in summary.items():
        if src == ALL and len(summary) == 2:
            continue  # a single source: its line says it all
        ks = [k for k in m if k.startswith(("pass@", "maj@"))]
        lines.append(f"{src}: prompts={int(m['n_prompts'])} samples={int(m['n_samples'])} "
                     + " ".join(f"{k}={m[k]:.4f}" for k in ks)
                     + f" mean_len={m['response_length']:.1f} truncated={m['truncation_rate']:.4f}")
    return "\n".join(lines)


def val_sampling(cfg) -> dict:
    """Sampling arguments of validation for ``RolloutEngine.generate`` from a :class:`rlhf.schema.config.Config`.

    ``trainer.val_kwargs.do_sample``: its n / temperature / top_p / top_k. Otherwise greedy,
    except that a legacy ``rollout.val_temperature > 0`` samples at that temperature with
    ``rollout.top_p`` / ``rollout.top_k`` (config validation forbids setting both).
    """
    vk = cfg.trainer.val_kwargs
    if vk.do_sample:
        return {"n": vk.n, "temperature": vk.temperature, "top_p": vk.top_p, "top_k": vk.top_k}
    return {"n": vk.n, "temperature": cfg.rollout.val_temperature}


def run_summary(steps: int, first_val: dict, last: dict) -> dict[str, float]:
    """The run's ``summary/*`` metrics: steps taken and the greedy ``val/acc`` before, after and its gain."""
    summary = {"summary/steps": float(steps)}
    if "val/acc" in first_val:
        summary["summary/val_acc_initial"] = first_val["val/acc"]
    if "val/acc" in last:
        summary["summary/val_acc_final"] = last["val/acc"]
    if "val/acc" in first_val and "val/acc" in last:
        summary["summary/val_acc_gain"] = last["val/acc"] - first_val["val/acc"]
    return summary
