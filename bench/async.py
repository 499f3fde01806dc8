"""Colocated (4 ranks generate, then 4 ranks train) vs one_step_off (2 generate while 2 train) vs
fully_async (2 rollout ranks stream groups to 2 training ranks, the sampler's log-probs as the old
ones; and, for comparison, the earlier 3 rollout + 1 training rank with recomputed log-probs), in one run.

    python bench/async.py                           # ~2 min on a 2-core CPU
    python bench/async.py --lengths long-tail       # most responses short, a few up to ~8x the median
    python bench/async.py --steps 8 --response 128
    python bench/async.py --lengths long-tail --over-sample-only   # colocated vs colocated + over-sampling only

``--lengths long-tail`` stops a response at any of 8 of the tiny model's 102 character tokens
(``rollout.stop``): a near-geometric length with median ~R/11 and a tail to R, the regime where a
lockstep batch waits for its longest response and streaming does not. fully_async runs with
``staleness_threshold`` 1 (``--staleness``), a weight push every ``--trigger`` updates
(``trigger_parameter_sync_step``, default 1), partial rollout, truncated IS (cap 2),
``use_rollout_log_probs`` (``--recompute`` turns it off) on ``--rollout-ranks`` of the 4 ranks.
Printed for fully_async: the training rank's seconds per step by phase (the bottleneck of 3 + 1).
``--over-sample RATE`` (default 0.1; 0 skips it) adds colocated with ``rollout.over_sample_rate``:
more prompts start than the step needs and the slowest groups are aborted (back to the data order);
its samples/s counts the trained samples (``batch x n`` a step, as colocated's).

Generation is made the dominant phase on purpose (long responses from a random tiny
model, which rarely stops early): that is the regime the pipeline is for. Both runs use
the same config, data and seeds; the first ``--warmup`` steps are not timed.

Printed per run: steps/s, and the share of wall time each role sits idle
(colocated: no role idles, but every rank runs both phases back to back; one_step_off:
the training ranks' wait for the next batch, ``async/train_wait_s`` over the step, and the
rollout ranks' wait for weights and for the partner to take the batch over their own
generate-and-hand-over cycle, ``async/rollout_idle_share``; fully_async: each role's idle
seconds over its wall time between updates). Each is a share of the role's own wall time, so
the modes compare. (The rollout figure was once ``async/rollout_idle_s`` over the trainer's step
time: no share, and the row of step 3 carries the wait through the slow first step, which
printed 600%+.)

Expected gain, from phase times, beside the measured one:

* ``ideal overlap``: colocated step time / max(rollout busy, training busy) of the
  one_step_off run, i.e. what perfect overlap of its own two roles would give;
* ``linear scaling``: colocated step / max(2 g4, 2 u4), with g4 and u4 the colocated
  generation and training phase times on 4 ranks, each phase assumed to take twice as long
  on half the ranks. Above 1 only where the phases do not scale linearly (on GPUs decoding
  is memory-bound, so half the ranks generate the same batch in less than twice the time).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tiny_run import add_shape_args, mean, tiny_grpo_rows  # noqa: E402


def FULLY_ASYNC(args, rollout_ranks: int, rollout_log_probs: bool) -> dict:
    """fully_async on ``rollout_ranks`` rollout + the rest training: an update per batch, weights pushed after each."""
    return {"parallel.rollout_ranks": rollout_ranks, "async_training.require_batches": 1,
            "async_training.staleness_threshold": args.staleness, "async_training.trigger_parameter_sync_step": args.trigger,
            "async_training.partial_rollout": True, "async_training.use_rollout_log_probs": rollout_log_probs}


TRAINER_PHASES = ("score", "logprobs", "advantage", "update", "async_exchange")


def wall_steps_per_s(rows: list[dict]) -> float:
    """Steps per second of the timed rows by the logger's wall clock (``time``): ``timing/step`` leaves
    out what the training leader does between steps (logging, the next step's set-up), which the
    other role waits through."""
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"]) if len(rows) > 1 else float("nan")


def one_step_off_rollout_idle_share(rows: list[dict]) -> float:
    """Mean rollout idle share of one_step_off's timed rows. Row j holds the cycle the rollout rank
    ended when it started batch j: it generated B_{j-1}, then waited for training step j-2 to take it
    and send theta_{j-2}. So the first two timed rows wait on untimed (warm-up) steps: left out."""
    rows = rows[2:] or rows
    return mean(rows, "async/rollout_idle_share")


def over_sampling_figures(colo: list[dict], over: list[dict], samples: int, rate: float) -> dict:
    """Colocated with ``rollout.over_sample_rate`` against colocated: trained samples per second, the
    generation phase, and what the sampler aborted and estimated it saved."""
    t_colo, t_over = mean(colo, "timing/step"), mean(over, "timing/step")
    return {"over_sample_rate": rate, "samples_per_s_colocated": samples / t_colo,
            "samples_per_s_colocated_over_sampling": samples / t_over, "over_sampling_vs_colocated": t_colo / t_over,
            "rollout_s_colocated": mean(colo, "timing/rollout"), "rollout_s_over_sampling": mean(over, "timing/rollout"),
            "over_sampling_aborted_groups": mean(over, "rollout/aborted"),
            "over_sampling_started_prompts": mean(over, "rollout/over_sample_started"),
            "over_sampling_saved_s_estimate": mean(over, "rollout/over_sample_saved_s"),
            # the sampler's own seconds (slowest replica) in colocated's step: even a free tail cannot save more
            "sampler_s_colocated": mean(colo, "rollout/seconds"),
            "bound_if_sampling_were_free": t_colo / (t_colo - mean(colo, "rollout/seconds"))}


def print_over_sampling(o: dict) -> None:
    print(f"colocated + over_sample_rate {o['over_sample_rate']}: {o['samples_per_s_colocated_over_sampling']:.1f} "
          f"samples/s vs colocated {o['samples_per_s_colocated']:.1f} ({o['over_sampling_vs_colocated']:.2f}x); "
          f"generation {o['rollout_s_over_sampling']:.2f} s vs {o['rollout_s_colocated']:.2f} s a step, "
          f"{o['over_sampling_aborted_groups']:.1f} of {o['over_sampling_started_prompts']:.0f} started groups aborted, "
          f"estimated saving {o['over_sampling_saved_s_estimate']:.2f} s a step; the sampler is "
          f"{o['sampler_s_colocated']:.2f} s of colocated's step: {o['bound_if_sampling_were_free']:.2f}x if it took no time")


def trainer_breakdown(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per step of the training rank's phases, and its wait for groups."""
    out = {p: mean(rows, f"timing/{p}") for p in TRAINER_PHASES}
    out["wait"] = mean(rows, "async/train_wait_s")
    out["step"] = mean(rows, "timing/step")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, steps=8, batch=16, n=4, response=96)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lengths", choices=("uniform", "long-tail"), default="uniform")
    ap.add_argument("--staleness", type=float, default=1.0, help="fully_async staleness_threshold")
    ap.add_argument("--trigger", type=int, default=1,
                    help="fully_async trigger_parameter_sync_step: updates between weight pushes")
    ap.add_argument("--rollout-ranks", type=int, default=2, help="fully_async: rollout ranks of the 4")
    ap.add_argument("--recompute", action="store_true",
                    help="fully_async: the trainer recomputes old log-probs (default: use_rollout_log_probs)")
    ap.add_argument("--baseline-split", type=int, default=3,
                    help="also run fully_async with this many rollout ranks and recomputed log-probs (the "
                         "earlier default, 3 + 1); 0: skip")
    ap.add_argument("--over-sample", type=float, default=0.1,
                    help="also run colocated with this rollout.over_sample_rate; 0: skip")
    ap.add_argument("--over-sample-only", action="store_true",
                    help="run only colocated and colocated + over-sampling")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--over-sample-only: alternate the two runs this many times; medians are printed")
    args = ap.parse_args()
    lengths = {"rollout.stop": "[a,b,c,d,e,f,g,h]"} if args.lengths == "long-tail" else {}
    from tests._assets import write_tiny_assets

    with tempfile.TemporaryDirectory() as tmp:
        assets = write_tiny_assets(Path(tmp) / "assets", n_train=256, n_val=16)
        runs = [("colocated", {}), ("one_step_off", {}),
                ("fully_async", FULLY_ASYNC(args, args.rollout_ranks, not args.recompute))]
        if args.baseline_split and not args.over_sample_only:
            runs.append(("fully_async", FULLY_ASYNC(args, args.baseline_split, False)))
        if args.over_sample_only:
            runs = [("colocated", {}), ("colocated", {"rollout.over_sample_rate": args.over_sample})] * args.repeats
        elif args.over_sample:
            runs.append(("colocated", {"rollout.over_sample_rate": args.over_sample}))
        rows = [tiny_grpo_rows(assets, Path(tmp) / f"run{i}", batch=args.batch, n=args.n, response=args.response,
                               steps=args.steps, warmup=args.warmup, nproc=4, **{
                                   "trainer.mode": mode, "actor.tis_imp_ratio_cap": 2.0, **lengths, **extra})
                for i, (mode, extra) in enumerate(runs)]
    if args.over_sample_only:  # colocated, over-sampling, colocated, ...: the median of each figure
        each = [over_sampling_figures(rows[i], rows[i + 1], args.batch * args.n, args.over_sample)
                for i in range(0, len(rows), 2)]
        over = {k: statistics.median(e[k] for e in each) for k in each[0]}
        print_over_sampling(over)
        print(json.dumps({**over, "repeats": each, "config": vars(args)}))
        return
    over = over_sampling_figures(rows[0], rows[-1], args.batch * args.n, args.over_sample) if args.over_sample else None
    colo, off, full = rows[:3]
    base = rows[3] if args.baseline_split else None
    t_colo, t_off = mean(colo, "timing/step"), mean(off, "timing/step")
    g4 = mean(colo, "timing/rollout")
    u4 = t_colo - g4
    gen_busy = mean(off, "async/rollout_generate_s")
    train_busy = t_off - mean(off, "async/train_wait_s")
    res = {
        "steps_per_s_colocated": 1 / t_colo, "steps_per_s_one_step_off": 1 / t_off, "speedup": t_colo / t_off,
        "colocated_generate_share": g4 / t_colo,
        "one_step_off_train_idle_share": mean(off, "async/train_wait_s") / t_off,
        "one_step_off_rollout_idle_share": one_step_off_rollout_idle_share(off),
        "expected_ideal_overlap": t_colo / max(gen_busy, train_busy),
        "expected_linear_scaling": t_colo / max(2 * g4, 2 * u4),
        "policy_lag_mean": mean(off, "async/policy_lag"),
        "steps_per_s_fully_async": 1 / mean(full, "timing/step"),
        "fully_async_train_idle_share": mean(full, "async/trainer_idle_share"),
        "fully_async_rollout_idle_share": mean(full, "async/rollout_idle_share"),
        "fully_async_staleness_mean": mean(full, "async/staleness_mean"),
        "fully_async_staleness_max": max(r["async/staleness_max"] for r in full),
        "response_length_mean": mean(colo, "response_length/mean"),
        "response_length_max": mean(colo, "response_length/max"),
        "config": vars(args),
    }
    res["fully_async_trainer_s"] = trainer_breakdown(full)
    if over is not None:
        res.update(over)
    if base is not None:
        res["steps_per_s_fully_async_baseline_split"] = 1 / mean(base, "timing/step")
        res["fully_async_baseline_split_train_idle_share"] = mean(base, "async/trainer_idle_share")
        res["fully_async_baseline_split_rollout_idle_share"] = mean(base, "async/rollout_idle_share")
        res["fully_async_baseline_split_trainer_s"] = trainer_breakdown(base)
    for mode, r in (("colocated", colo), ("one_step_off", off), ("fully_async", full)):
        res[f"wall_steps_per_s_{mode}"] = wall_steps_per_s(r)
    samples = args.batch * args.n
    for mode in ("colocated", "one_step_off", "fully_async"):
        res[f"samples_per_s_{mode}"] = res[f"steps_per_s_{mode}"] * samples
    res["fully_async_vs_one_step_off"] = res["steps_per_s_fully_async"] / res["steps_per_s_one_step_off"]
    res["fully_async_vs_colocated"] = res["steps_per_s_fully_async"] / res["steps_per_s_colocated"]
    print(f"colocated    4 ranks: {res['steps_per_s_colocated']:.3f} steps/s, generation {res['colocated_generate_share']:.0%} "
          f"of the step (g4 {g4:.2f} s, rest u4 {u4:.2f} s)")
    print(f"one_step_off 2+2    : {res['steps_per_s_one_step_off']:.3f} steps/s, training ranks idle "
          f"{res['one_step_off_train_idle_share']:.0%}, rollout ranks idle {res['one_step_off_rollout_idle_share']:.0%} "
          f"(rollout busy {gen_busy:.2f} s, training busy {train_busy:.2f} s per step)")
    print(f"speedup one_step_off / colocated: measured {res['speedup']:.2f}x; expected {res['expected_ideal_overlap']:.2f}x "
          f"with ideal overlap of the measured busy times, {res['expected_linear_scaling']:.2f}x if each phase took "
          f"twice as long on half the ranks")
    split = f"{4 - args.rollout_ranks}+{args.rollout_ranks}"
    if base is not None:
        b = res["fully_async_baseline_split_trainer_s"]
        print(f"fully_async  {4 - args.baseline_split}+{args.baseline_split} (train+rollout), recomputed log-probs: "
              f"{res['steps_per_s_fully_async_baseline_split']:.3f} steps/s, trainer idle "
              f"{res['fully_async_baseline_split_train_idle_share']:.0%}, rollout idle "
              f"{res['fully_async_baseline_split_rollout_idle_share']:.0%}; trainer s/step: "
              + ", ".join(f"{k} {v:.3f}" for k, v in b.items()))
    print("fully_async trainer s/step: " + ", ".join(f"{k} {v:.3f}" for k, v in res["fully_async_trainer_s"].items()))
    print(f"fully_async  {split} (train+rollout): {res['steps_per_s_fully_async']:.3f} steps/s ({res['samples_per_s_fully_async']:.1f} "
          f"samples/s), trainer idle {res['fully_async_train_idle_share']:.0%}, rollout idle "
          f"{res['fully_async_rollout_idle_share']:.0%}, staleness mean {res['fully_async_staleness_mean']:.2f} max "
          f"{res['fully_async_staleness_max']:.0f}; {res['fully_async_vs_one_step_off']:.2f}x one_step_off, "
          f"{res['fully_async_vs_colocated']:.2f}x colocated")
    print(f"by wall clock (logged rows): colocated {res['wall_steps_per_s_colocated']:.3f}, one_step_off "
          f"{res['wall_steps_per_s_one_step_off']:.3f}, fully_async {res['wall_steps_per_s_fully_async']:.3f} steps/s; "
          f"fully_async {res['wall_steps_per_s_fully_async'] / res['wall_steps_per_s_one_step_off']:.2f}x one_step_off, "
          f"{res['wall_steps_per_s_fully_async'] / res['wall_steps_per_s_colocated']:.2f}x colocated")
    if over is not None:
        print_over_sampling(over)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
