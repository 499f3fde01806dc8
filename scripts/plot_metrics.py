"""Plot metrics from a run's ``metrics.jsonl`` against the training step.

    python scripts/plot_metrics.py RUN_DIR/metrics.jsonl --out docs/quickstart_curve.png \
        --keys val/acc reward/mean

One panel per key. Sparse metrics (e.g. ``val/*``, logged every few steps) are drawn only
at the steps where they exist, with markers. If a resumed run logged a step twice, the
last value wins.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlhf.ops.metrics import read_metrics  # noqa: E402


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, last value per step, sorted by step, non-finite dropped."""
    by_step: dict[int, float] = {}
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            by_step[int(row["step"])] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot(rows: list[dict], keys: list[str], out: Path, title: str | None = None) -> None:
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps, vals = series(rows, key)
        sparse = len(steps) < 0.5 * len(rows)
        ax.plot(steps, vals, marker="o" if sparse else None, markersize=4)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", type=Path, help="path to metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="output image (png, pdf, svg)")
    parser.add_argument("--keys", nargs="+", default=["val/acc", "reward/mean"], help="metrics to plot")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"metrics file not found: {args.metrics}")
    rows = read_metrics(args.metrics)
    present = {k for row in rows for k in row}
    missing = [k for k in args.keys if k not in present]
    if missing:
        available = sorted(present - {"step", "time"})
        parser.error(f"metric(s) {missing} not in {args.metrics}; available: {available}")
    plot(rows, args.keys, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
