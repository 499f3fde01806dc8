"""The tools quickstart's task: multi-digit multiplication, which a tiny model can only do with a calculator.

* prompt ``[{"role": "user", "content": "482*376="}]``: two 3-digit numbers whose product has
  6 digits (fixed widths put the digits to copy at fixed distances, which a tiny model learns
  to copy from a few thousand demonstrations);
* answered with the tool: an assistant turn
  ``<tool_call>{"name":"calculator","arguments":{"expression":"482*376"}}</tool_call>``, the
  tool's turn ``181232``, then ``#### 181232`` (the ``####`` line the ``gsm8k`` reward reads);
* answered by estimation: ``~200000`` (both factors rounded to hundreds, 500 * 400), which the
  reward does not take as an answer (no ``####``). Keeping ``####`` for answers read off the
  tool leaves the model one context to copy digits in, instead of two that interfere.

The demonstrations come from a hasty teacher: it calls the calculator with probability
``teacher_tool_rate`` and otherwise estimates. After the supervised warm start the greedy
policy estimates, like most of the teacher's answers, and scores 0; sampling calls the tool
now and then, and those trajectories can be right: the signal GRPO with tools turns into a
policy that uses the tool. Without the tool a policy of this size has nothing better: a
0.8M-parameter character model does not learn 3-by-3-digit multiplication from a few
thousand examples.

Files written by :func:`make_multiplication_task`: ``train.parquet``, ``val.parquet`` (verl's
schema) and ``sft.jsonl`` (multi-turn demonstrations, :mod:`rlhf.agent.demos`).
CLI: ``python -m rlhf.data.arithmetic --out DIR [--n-train N ...]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rlhf.data.synthetic import write_task

DATA_SOURCE = "synthetic/multiplication"


def problem(rng: random.Random) -> tuple[int, int]:
    """``(a, b)``: 3 digits each, ``a * b`` with 6."""
    while True:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if a * b >= 100_000:
            return a, b


def tool_call(expression: str) -> str:
    args = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>" + json.dumps(args, separators=(",", ":")) + "</tool_call>"


def tool_demo(a: int, b: int) -> list[dict[str, str]]:
    """The response messages of a demonstration that uses the calculator."""
    return [{"role": "assistant", "content": tool_call(f"{a}*{b}")}, {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"#### {a * b}"}]


def estimate_demo(a: int, b: int) -> list[dict[str, str]]:
    """The teacher's answer without the tool: the product of the factors rounded to hundreds."""
    return [{"role": "assistant", "content": f"~{round(a, -2) * round(b, -2)}"}]


def _rows(problems: list[tuple[int, int]], split: str) -> list[dict[str, Any]]:
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)}, "extra_info": {"split": split, "index": i}}
            for i, (a, b) in enumerate(problems)]


def make_multiplication_task(out_dir: str | Path, *, n_train: int = 4000, n_val: int = 256, n_sft: int = 8000,
                             seed: int = 0, teacher_tool_rate: float = 0.4) -> dict[str, Path]:
    """Write the task to ``out_dir``; everything is a function of the seed and the sizes.

    Args:
        n_train, n_val: RL training and validation prompts (distinct problems).
        n_sft: demonstrations, on training problems (cycled when ``n_sft > n_train``).
        teacher_tool_rate: probability that a demonstration calls the calculator.

    Returns:
        ``{"train": path, "val": path, "sft": path}``.
    """
    if not 0.0 <= teacher_tool_rate <= 1.0:
        raise ValueError(f"teacher_tool_rate must be in [0, 1], got {teacher_tool_rate}")
    if min(n_train, n_val, n_sft) < 0 or (n_sft > 0 and n_train == 0):
        raise ValueError(f"sizes must be >= 0 and n_sft > 0 needs n_train > 0; got {n_train}, {n_val}, {n_sft}")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[tuple[int, int]] = []
    while len(problems) < n_train + n_val:
        p = problem(rng)
        if p not in seen:
            seen.add(p)
            problems.append(p)
    train, val = problems[:n_train], problems[n_train:]
    teacher = random.Random(seed + 1)
    sft = []
    for k in range(n_sft):
        a, b = train[k % n_train]
        demo = tool_demo(a, b) if teacher.random() < teacher_tool_rate else estimate_demo(a, b)
        sft.append({"prompt": [{"role": "user", "content": f"{a}*{b}="}], "response": demo})
    return write_task(out_dir, _rows(train, "train"), _rows(val, "val"), sft)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the multiplication-with-a-calculator task (verl schema).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--n-sft", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher-tool-rate", type=float, default=0.4)
    a = ap.parse_args(argv)
    paths = make_multiplication_task(a.out, n_train=a.n_train, n_val=a.n_val, n_sft=a.n_sft, seed=a.seed,
                                     teacher_tool_rate=a.teacher_tool_rate)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
