"""Colocated (4 ranks generate, then 4 ranks train) vs one_step_off (2 generate while 2 train), in one run.

    python bench/async.py                           # ~1 min on a 2-core CPU
    python bench/async.py --steps 8 --response 128

Generation is made the dominant phase on purpose (long responses from a random tiny
model, which rarely stops early): that is the regime the pipeline is for. Both runs use
the same config, data and seeds; the first ``--warmup`` steps are not timed.

Printed per run: steps/s, and the share of wall time each role sits idle
(colocated: no role idles, but every rank runs both phases back to back; one_step_off:
the training ranks' wait for the next batch, ``async/train_wait_s``, and the rollout
ranks' wait for weights and for the partner to take the batch, ``async/rollout_idle_s``).

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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tiny_run import add_shape_args, mean, tiny_grpo_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, steps=8, batch=16, n=4, response=96)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from tests._assets import write_tiny_assets

    with tempfile.TemporaryDirectory() as tmp:
        assets = write_tiny_assets(Path(tmp) / "assets", n_train=256, n_val=16)
        colo, off = (tiny_grpo_rows(assets, Path(tmp) / mode, batch=args.batch, n=args.n, response=args.response,
                                    steps=args.steps, warmup=args.warmup, nproc=4, **{
                                        "trainer.mode": mode, "actor.tis_imp_ratio_cap": 2.0})
                     for mode in ("colocated", "one_step_off"))
    t_colo, t_off = mean(colo, "timing/step"), mean(off, "timing/step")
    g4 = mean(colo, "timing/rollout")
    u4 = t_colo - g4
    gen_busy = mean(off, "async/rollout_generate_s")
    train_busy = t_off - mean(off, "async/train_wait_s")
    res = {
        "steps_per_s_colocated": 1 / t_colo, "steps_per_s_one_step_off": 1 / t_off, "speedup": t_colo / t_off,
        "colocated_generate_share": g4 / t_colo,
        "one_step_off_train_idle_share": mean(off, "async/train_wait_s") / t_off,
        "one_step_off_rollout_idle_share": mean(off, "async/rollout_idle_s") / t_off,
        "expected_ideal_overlap": t_colo / max(gen_busy, train_busy),
        "expected_linear_scaling": t_colo / max(2 * g4, 2 * u4),
        "policy_lag_mean": mean(off, "async/policy_lag"),
        "config": vars(args),
    }
    print(f"colocated    4 ranks: {res['steps_per_s_colocated']:.3f} steps/s, generation {res['colocated_generate_share']:.0%} "
          f"of the step (g4 {g4:.2f} s, rest u4 {u4:.2f} s)")
    print(f"one_step_off 2+2    : {res['steps_per_s_one_step_off']:.3f} steps/s, training ranks idle "
          f"{res['one_step_off_train_idle_share']:.0%}, rollout ranks idle {res['one_step_off_rollout_idle_share']:.0%} "
          f"(rollout busy {gen_busy:.2f} s, training busy {train_busy:.2f} s per step)")
    print(f"speedup one_step_off / colocated: measured {res['speedup']:.2f}x; expected {res['expected_ideal_overlap']:.2f}x "
          f"with ideal overlap of the measured busy times, {res['expected_linear_scaling']:.2f}x if each phase took "
          f"twice as long on half the ranks")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
