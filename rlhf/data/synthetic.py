"""The quickstart's verifiable task: 2-digit addition with a worked answer.

Why this task: it runs end to end on a CPU in minutes with a tiny model and a character
tokenizer, yet it has the structure of a real RLVR recipe. A supervised warm-start on
*imperfect* demonstrations, then RL against a rule-based reward, fixes what the
demonstrations got wrong:

* prompt ``[{"role": "user", "content": "47+38="}]``
* correct response ``"7+8=15;4+3+1=8 #### 85"`` — ones-digit sum, tens-digit sum plus the
  carry, then the GSM8K-style final answer that the ``gsm8k`` reward reads;
* the teacher forgets the carry with probability ``teacher_carry_error`` on problems that
  have one: ``"7+8=15;4+3=7 #### 75"``.

After SFT the greedy policy imitates the majority behaviour (drop the carry), so accuracy
on carry problems starts low, while sampling sometimes produces the carried version — the
reward signal that GRPO/PPO amplify.

Files written by :func:`make_addition_task` (verl's parquet schema):
``train.parquet``, ``val.parquet`` and ``sft.jsonl`` (``{"prompt": messages, "response": str}``).
CLI: ``python -m rlhf.data.synthetic --out DIR [--n-train N ...]``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "synthetic/addition"
ABILITY = "math"
_N_PAIRS = 90 * 90  # operands in [10, 99]


@dataclass(frozen=True)
class AdditionProblem:
    """One problem ``a + b`` with 2-digit operands."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def has_carry(self) -> bool:
        return (self.a % 10) + (self.b % 10) >= 10

    @property
    def prompt_text(self) -> str:
        return f"{self.a}+{self.b}="

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt_text}]


def correct_response(p: AdditionProblem) -> str:
    """The worked answer, e.g. 47+38 -> ``"7+8=15;4+3+1=8 #### 85"``."""
    a1, a10, b1, b10 = p.a % 10, p.a // 10, p.b % 10, p.b // 10
    ones = a1 + b1
    carry = ones // 10
    tens = a10 + b10 + carry
    tens_expr = f"{a10}+{b10}+1" if carry else f"{a10}+{b10}"
    return f"{a1}+{b1}={ones};{tens_expr}={tens} #### {p.answer}"


def carry_dropped_response(p: AdditionProblem) -> str:
    """The flawed teacher's answer: the carry is forgotten, e.g. ``"7+8=15;4+3=7 #### 75"``."""
    a1, a10, b1, b10 = p.a % 10, p.a // 10, p.b % 10, p.b // 10
    ones = a1 + b1
    tens = a10 + b10
    wrong = tens * 10 + ones % 10
    return f"{a1}+{b1}={ones};{a10}+{b10}={tens} #### {wrong}"


def teacher_response(p: AdditionProblem, rng: random.Random, carry_error: float) -> str:
    """A demonstration from the flawed teacher (drops the carry w.p. ``carry_error``)."""
    # Draw for every problem, carry or not, so the random stream does not depend on the
    # operands and a given seed always pairs the same draws with the same rows.
    u = rng.random()
    if p.has_carry and u < carry_error:
        return carry_dropped_response(p)
    return correct_response(p)


def sample_problems(n: int, rng: random.Random) -> list[AdditionProblem]:
    """``n`` distinct problems, in random order."""
    if n > _N_PAIRS:
        raise ValueError(f"only {_N_PAIRS} distinct 2-digit addition problems exist; asked for {n}")
    pair_ids = rng.sample(range(_N_PAIRS), n)
    return [AdditionProblem(10 + k // 90, 10 + k % 90) for k in pair_ids]


def _verl_rows(problems: list[AdditionProblem], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": p.messages(),
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(problems)
    ]


def write_task(out_dir: str | Path, train: list[dict[str, Any]], val: list[dict[str, Any]],
               sft: list[dict[str, Any]]) -> dict[str, Path]:
    """``train.parquet`` and ``val.parquet`` (verl rows) and ``sft.jsonl`` (demonstrations) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet", "sft": out / "sft.jsonl"}
    pq.write_table(pa.Table.from_pylist(train), paths["train"])
    pq.write_table(pa.Table.from_pylist(val), paths["val"])
    paths["sft"].write_text("".join(json.dumps(row) + "\n" for row in sft))
    return paths


def make_addition_task(
    out_dir: str | Path,
    *,
    n_train: int = 4000,
    n_val: int = 256,
    n_sft: int = 2000,
    seed: int = 0,
    teacher_carry_error: float = 0.6,
) -> dict[str, Path]:
    """Write the synthetic addition task to ``out_dir``.

    Args:
        out_dir: directory to create/fill.
        n_train: RL training prompts (``train.parquet``).
        n_val: validation prompts (``val.parquet``), disjoint from the training prompts.
        n_sft: supervised demonstrations (``sft.jsonl``), drawn from the training prompts
            (cycled if ``n_sft > n_train``), answered by the flawed teacher.
        seed: everything written is a deterministic function of the seed and the sizes.
        teacher_carry_error: probability that the teacher forgets the carry on a problem
            that has one.

    Returns:
        ``{"train": path, "val": path, "sft": path}``.
    """
    if not 0.0 <= teacher_carry_error <= 1.0:
        raise ValueError(f"teacher_carry_error must be in [0, 1], got {teacher_carry_error}")
    if min(n_train, n_val, n_sft) < 0:
        raise ValueError(f"sizes must be >= 0, got n_train={n_train} n_val={n_val} n_sft={n_sft}")
    if n_sft > 0 and n_train == 0:
        raise ValueError("n_sft > 0 needs n_train > 0: demonstrations are drawn from the training prompts")
    rng = random.Random(seed)
    problems = sample_problems(n_train + n_val, rng)
    train, val = problems[:n_train], problems[n_train:]
    teacher_rng = random.Random(seed + 1)
    sft_order = list(range(n_train))
    teacher_rng.shuffle(sft_order)
    sft = []
    for k in range(n_sft):
        p = train[sft_order[k % n_train]]
        sft.append({"prompt": p.messages(), "response": teacher_response(p, teacher_rng, teacher_carry_error)})
    return write_task(out_dir, _verl_rows(train, "train"), _verl_rows(val, "val"), sft)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic 2-digit addition task (verl schema).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-val", type=int, default=256)
    parser.add_argument("--n-sft", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-carry-error", type=float, default=0.6)
    args = parser.parse_args(argv)
    paths = make_addition_task(
        args.out,
        n_train=args.n_train,
        n_val=args.n_val,
        n_sft=args.n_sft,
        seed=args.seed,
        teacher_carry_error=args.teacher_carry_error,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
