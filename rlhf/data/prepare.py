"""Turn local copies of public math datasets into verl-schema prompt files.

    python -m rlhf.data.prepare gsm8k --in gsm8k/train.parquet --out data/gsm8k
    python -m rlhf.data.prepare gsm8k --in gsm8k/test.parquet --out data/gsm8k --split test
    python -m rlhf.data.prepare math --in MATH-lighteval/train.parquet --out data/math --test-size 500
    python -m rlhf.data.prepare dapo_math --in dapo-math-17k.parquet --out data/dapo
    python -m rlhf.data.prepare geo3k --in geometry3k/train.parquet --out data/geo3k

Input layouts (parquet or jsonl, as published):

* ``gsm8k`` (openai/gsm8k): ``question``, ``answer`` (a worked solution ending in
  ``#### <number>``). Prompt = question + verl's instruction
  ``Let's think step by step and output the final answer after "####".``
* ``math`` (DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500): ``problem``,
  ``solution`` (answer in its last ``\\boxed{}``; an ``answer`` column, as in MATH-500,
  is preferred). Prompt = problem + ``Let's think step by step and output the final
  answer within \\boxed{}.``
* ``dapo_math`` (BytedTsinghua-SIA/DAPO-Math-17k): already in verl's schema, with the
  ``Answer:`` instructions inside the prompt; rows are checked, re-indexed, and exact
  duplicate prompts dropped (the published file repeats each problem many times).
* ``geo3k`` (hiyouga/geometry3k, a vision-language set): ``problem`` (with one ``<image>``
  placeholder per image), ``answer``, ``images`` (``{"bytes", "path"}`` structs, kept as they are).
  Prompt = problem + verl's ``You FIRST think about the reasoning process ... \\boxed{}.``
  instruction; write parquet (jsonl cannot hold the image bytes).

Output rows (``DIR/<split>.parquet``, or ``.jsonl`` with ``--format jsonl``)::

    {"data_source": ..., "prompt": [{"role": "user", "content": ...}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": ...}, "extra_info": {"split": ..., "index": i, ...}}

Rows that cannot be used are skipped and counted by reason; a file without a required
column, or an unknown dataset name, ends the command with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.answers import extract_solution
from rlhf.data.answers import extract_boxed_answer
from rlhf.data.dataset import DataError, read_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GEO3K_INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     "MUST BE put in \\boxed{}.")


class _Skip(Exception):
    """A row that is skipped; the message is the reason (counted)."""


@dataclass
class Layout:
    """One dataset: the columns it needs and how a row becomes a verl row."""

    columns: tuple[str, ...]
    data_source: str
    convert: Callable[[dict[str, Any]], tuple[Any, str, dict[str, Any]]]  # row -> (prompt, ground_truth, extra)
    dedup: bool = False
    images: bool = False  # the rows keep their ``images`` column (verl's multimodal schema)


def _text(row: dict[str, Any], col: str) -> str:
    v = row.get(col)
    if not isinstance(v, str) or not v.strip():
        raise _Skip(f"empty '{col}'")
    return v


def _gsm8k(row: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    question, answer = _text(row, "question"), _text(row, "answer")
    gt = extract_solution(answer, "strict")  # the reward's own reading of "#### <number>"
    if gt is None:
        raise _Skip("no '#### <number>' in answer")
    prompt = [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}]
    return prompt, gt, {"answer": answer, "question": question}


def _math(row: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    problem = _text(row, "problem")
    gt = row.get("answer")
    if not isinstance(gt, str) or not gt.strip():
        gt = extract_boxed_answer(row.get("solution") or "")
        if not gt:
            raise _Skip("no \\boxed{} answer in solution")
    extra = {k: row[k] for k in ("level", "type", "subject", "unique_id") if isinstance(row.get(k), (str, int))}
    return [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}], gt.strip(), extra


def _dapo(row: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in prompt):
        raise _Skip("prompt is not a list of {role, content} messages")
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    if gt is None or str(gt).strip() == "":
        raise _Skip("no reward_model.ground_truth")
    old = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    extra = {"original_index": str(old["index"])} if old.get("index") is not None else {}
    return [{"role": m["role"], "content": m["content"]} for m in prompt], str(gt).strip(), extra


def _geo3k(row: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    problem, answer = _text(row, "problem"), _text(row, "answer")
    images = row.get("images")
    if not isinstance(images, list) or not images:
        raise _Skip("no images")
    if problem.count("<image>") != len(images):
        raise _Skip("'<image>' placeholders do not match the images")
    return [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}], answer.strip(), \
        {"answer": answer, "question": problem}


LAYOUTS: dict[str, Layout] = {
    "gsm8k": Layout(("question", "answer"), "openai/gsm8k", _gsm8k),
    "math": Layout(("problem", "solution|answer"), "DigitalLearningGmbH/MATH-lighteval", _math),
    "dapo_math": Layout(("prompt", "reward_model"), "math_dapo", _dapo, dedup=True),
    "geo3k": Layout(("problem", "answer", "images"), "hiyouga/geometry3k", _geo3k, images=True),
}


@dataclass
class PrepareReport:
    n_read: int = 0
    written: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    first_skipped_row: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in self.written.items())
        s = f"{self.n_read} rows read, {sum(self.written.values())} written ({parts}); {sum(self.skipped.values())} skipped"
        if self.skipped:
            s += ": " + "; ".join(f"{n} {why} (first: row {self.first_skipped_row[why]})"
                                  for why, n in self.skipped.most_common())
        return s


def _check_columns(path: Path, rows: list[dict[str, Any]], name: str, layout: Layout) -> None:
    present = set().union(*(r.keys() for r in rows[:100] if isinstance(r, dict))) if rows else set()
    for col in layout.columns:
        options = col.split("|")
        if not any(o in present for o in options):
            need = " or ".join(f"'{o}'" for o in options)
            raise DataError(f"{path}: column {need} missing for the {name} layout (needs "
                            f"{', '.join(layout.columns)}; found: {', '.join(sorted(present)) or 'no columns'})")


def convert(name: str, rows: list[dict[str, Any]], *, split: str, data_source: Optional[str] = None,
            dedup: Optional[bool] = None, report: Optional[PrepareReport] = None) -> list[dict[str, Any]]:
    """verl rows from raw ``rows`` of dataset ``name``; skipped rows are counted in ``report``."""
    layout = get_layout(name)
    report = report if report is not None else PrepareReport()
    dedup = layout.dedup if dedup is None else dedup
    seen: set[str] = set()
    out = []
    for r, row in enumerate(rows):
        try:
            if row is None:
                raise _Skip("invalid JSON line")
            if not isinstance(row, dict):
                raise _Skip("row is not an object")
            prompt, gt, extra = layout.convert(row)
            if dedup:
                key = json.dumps(prompt, sort_keys=True)
                if key in seen:
                    raise _Skip("duplicate prompt")
                seen.add(key)
        except _Skip as e:
            report.skipped[str(e)] += 1
            report.first_skipped_row.setdefault(str(e), r)
            continue
        source = data_source or (row.get("data_source") if name == "dapo_math" else None) or layout.data_source
        out.append({"data_source": source, "prompt": prompt, "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": gt},
                    "extra_info": {"split": split, "index": len(out), **extra},
                    **({"images": row["images"]} if layout.images else {})})
    return out


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise DataError(f"unknown dataset '{name}'; known: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[name]


def _resplit(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    return [{**r, "extra_info": {**r["extra_info"], "split": split, "index": i}} for i, r in enumerate(rows)]


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        if any("images" in r for r in rows):
            raise DataError(f"{path}: image rows cannot be written as jsonl (the image bytes); use --format parquet")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


def prepare(name: str, inputs: list[str], out_dir: str, *, split: str = "train", test_size: float = 0.0,
            seed: int = 0, data_source: Optional[str] = None, dedup: Optional[bool] = None,
            fmt: str = "parquet") -> PrepareReport:
    """Read ``inputs``, convert, optionally hold out ``test_size`` rows (a count, or a fraction
    if < 1) as ``test``, and write ``out_dir/<split>.<fmt>``. Returns the counts."""
    layout = get_layout(name)
    report = PrepareReport()
    rows: list[dict[str, Any]] = []
    for f in inputs:
        raw, _ = read_rows(Path(f))  # invalid JSON lines come back as None: skipped and counted
        if not raw:
            raise DataError(f"{f}: the file has no rows")
        _check_columns(Path(f), raw, name, layout)
        report.n_read += len(raw)
        rows += raw
    converted = convert(name, rows, split=split, data_source=data_source, dedup=dedup, report=report)
    if not converted:
        raise DataError(f"no usable row in {inputs}: {report.summary()}")
    splits = {split: converted}
    if test_size > 0:
        n_test = int(round(test_size * len(converted))) if test_size < 1 else int(test_size)
        if not 0 < n_test < len(converted):
            raise DataError(f"--test-size {test_size} leaves no train or no test rows out of {len(converted)}")
        order = list(range(len(converted)))
        random.Random(seed).shuffle(order)
        test_idx = set(order[:n_test])
        splits = {split: _resplit([r for i, r in enumerate(converted) if i not in test_idx], split),
                  "test": _resplit([converted[i] for i in sorted(test_idx)], "test")}
    for s, part in splits.items():
        write_rows(part, Path(out_dir) / f"{s}.{fmt}")
        report.written[s] = len(part)
    return report


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.data.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", help=f"one of: {', '.join(sorted(LAYOUTS))}")
    ap.add_argument("--in", dest="inputs", nargs="+", required=True, help="parquet / jsonl files as published")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--split", default="train", help="split name of the input (output file name)")
    ap.add_argument("--test-size", type=float, default=0.0,
                    help="hold out this many rows (or this fraction if < 1) as DIR/test")
    ap.add_argument("--seed", type=int, default=0, help="seed of the --test-size split")
    ap.add_argument("--data-source", default=None, help="data_source to write (picks the default reward)")
    ap.add_argument("--keep-duplicates", action="store_true", help="dapo_math: keep repeated prompts")
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = ap.parse_args(argv)
    try:
        report = prepare(args.dataset, args.inputs, args.out, split=args.split, test_size=args.test_size,
                         seed=args.seed, data_source=args.data_source,
                         dedup=False if args.keep_duplicates else None, fmt=args.format)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"[prepare] {args.dataset}: {report.summary()} -> {args.out}")


if __name__ == "__main__":
    main()
