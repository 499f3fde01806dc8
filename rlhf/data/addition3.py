"""A harder variant of the quickstart's task: 3-digit addition with a worked answer.

Why: on the 2-digit task GRPO reaches ~0.95 greedy val accuracy in two steps, which leaves little
room to compare methods (bench/distill_tokens.py). Three digits mean up to two carries per
problem, and a flawed teacher that forgets each one independently:

* prompt ``[{"role": "user", "content": "487+358="}]``
* correct response ``"7+8=15;8+5+1=14;4+3+1=8 #### 845"``: ones, tens plus carry, hundreds plus
  carry, then the ``####`` answer the ``gsm8k`` reward reads (data_source ``synthetic/addition``);
* the teacher drops each carry with probability ``teacher_carry_error`` (the digit sums after a
  dropped carry follow the wrong worked steps).

Files (verl's schema, as :mod:`rlhf.data.synthetic`): ``train.parquet``, ``val.parquet``, ``sft.jsonl``.
CLI: ``python -m rlhf.data.addition3 --out DIR [--n-train N ...]``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from rlhf.data.synthetic import ABILITY, DATA_SOURCE, write_task

_N_PAIRS = 900 * 900  # operands in [100, 999]


def worked_response(a: int, b: int, keep_carry: tuple[bool, bool] = (True, True)) -> str:
    """The worked answer, digit by digit; ``keep_carry[i]`` False drops the carry into digit i + 1."""
    steps, carry, total = [], 0, 0
    for i in range(3):
        da, db = a // 10 ** i % 10, b // 10 ** i % 10
        expr = f"{da}+{db}+1" if carry else f"{da}+{db}"
        s = da + db + carry
        steps.append(f"{expr}={s}")
        digit = s if i == 2 else s % 10
        total += digit * 10 ** i
        carry = s // 10 if i < 2 and keep_carry[i] else 0
    return ";".join(steps) + f" #### {total}"


def make_addition3_task(out_dir: str | Path, *, n_train: int = 4000, n_val: int = 256, n_sft: int = 8000,
                        seed: int = 0, teacher_carry_error: float = 0.6) -> dict[str, Path]:
    """Write the 3-digit task; returns ``{"train", "val", "sft"}`` paths. Deterministic in the seed."""
    if not 0.0 <= teacher_carry_error <= 1.0:
        raise ValueError(f"teacher_carry_error must be in [0, 1], got {teacher_carry_error}")
    rng = random.Random(seed)
    pairs = [(100 + k // 900, 100 + k % 900) for k in rng.sample(range(_N_PAIRS), n_train + n_val)]
    train, val = pairs[:n_train], pairs[n_train:]

    def rows(problems, split):
        return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                 "ability": ABILITY, "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                 "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(problems)]

    teacher_rng = random.Random(seed + 1)
    sft = []
    for k in range(n_sft):
        a, b = train[k % n_train] if n_train else (100, 100)
        keep = (teacher_rng.random() >= teacher_carry_error, teacher_rng.random() >= teacher_carry_error)
        sft.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": worked_response(a, b, keep)})
    return write_task(out_dir, rows(train, "train"), rows(val, "val"), sft)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic 3-digit addition task (verl schema).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--n-sft", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher-carry-error", type=float, default=0.6)
    a = ap.parse_args(argv)
    for name, path in make_addition3_task(a.out, n_train=a.n_train, n_val=a.n_val, n_sft=a.n_sft, seed=a.seed,
                                          teacher_carry_error=a.teacher_carry_error).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
