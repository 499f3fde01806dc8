"""The vision-language quickstart's task: count the shapes in a picture, which only the image tells.

* image: 32 x 32 px, black, cut into a 2 x 2 grid of 16 px cells; ``n`` (1-4, uniform) cells hold
  one shape each (a square or a disc, 6-11 px, of a random colour, at a random place in its cell);
* prompt ``[{"role": "user", "content": "<image>How many shapes?"}]`` with the image in verl's
  ``images`` column (PNG bytes), the same text for every row: the answer is in the pixels only;
* correct response ``#### 3`` (the ``####`` line the ``gsm8k`` reward reads).

Why a grid: a merged image token of the tiny Qwen2.5-VL (``rlhf.models.tiny_vlm``: 4 px patches,
merge 2) covers 8 x 8 px, so a cell is 2 x 2 tokens and counting is "how many cells are lit",
which a 0.1M-parameter vision tower learns in a few hundred SFT steps; free positions, sizes and
colours keep the images varied (thousands of distinct pictures).

The demonstrations come from a hasty teacher that undercounts crowded pictures: with
probability ``teacher_miscount`` it answers ``n - 1`` when ``n >= 3``. After the supervised warm
start the greedy policy copies the majority (``2`` for three shapes, ``3`` for four), so it scores
about 0.5 although it can tell the counts apart; sampling gives the right count now and then,
the signal GRPO turns into a policy that counts (docs/howto/vlm.md).

Files written by :func:`make_shapes_task`: ``train.parquet`` and ``val.parquet`` (verl's
multimodal schema) and ``sft.parquet`` (``prompt``, ``images``, ``response``).
CLI: ``python -m rlhf.data.shapes --out DIR [--n-train N ...]``.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "synthetic/shapes"
QUESTION = "<image>How many shapes?"
SIZE, CELL = 32, 16
COLOURS = ((230, 60, 60), (60, 200, 60), (70, 110, 240), (235, 220, 60), (220, 80, 220), (60, 220, 220),
           (250, 250, 250), (245, 150, 40))


def draw(n: int, rng: random.Random):
    """A PIL image with ``n`` shapes (1-4) in distinct cells of the 2 x 2 grid."""
    from PIL import Image, ImageDraw

    if not 1 <= n <= 4:
        raise ValueError(f"n must be in 1..4, got {n}")
    im = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    d = ImageDraw.Draw(im)
    for cell in rng.sample(range(4), n):
        s = rng.randint(6, 11)
        x = (cell % 2) * CELL + rng.randint(1, CELL - 1 - s)
        y = (cell // 2) * CELL + rng.randint(1, CELL - 1 - s)
        box, colour = (x, y, x + s - 1, y + s - 1), rng.choice(COLOURS)
        (d.rectangle if rng.random() < 0.5 else d.ellipse)(box, fill=colour)
    return im


def png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def answer(n: int) -> str:
    return f"#### {n}"


def teacher_answer(n: int, rng: random.Random, miscount: float) -> str:
    """The hasty teacher: ``n - 1`` with probability ``miscount`` when ``n >= 3``, else ``n``."""
    u = rng.random()  # drawn for every row, so a seed pairs the same draws with the same rows
    return answer(n - 1 if n >= 3 and u < miscount else n)


def _row(n: int, image: bytes, split: str, i: int) -> dict[str, Any]:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": image, "path": None}], "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(n)}, "extra_info": {"split": split, "index": i}}


def make_shapes_task(out_dir: str | Path, *, n_train: int = 2000, n_val: int = 128, n_sft: int = 4000,
                     seed: int = 0, teacher_miscount: float = 0.6) -> dict[str, Path]:
    """Write the task to ``out_dir``; everything is a function of the seed and the sizes.

    Args:
        n_train, n_val: RL training and validation pictures (drawn independently).
        n_sft: demonstrations on fresh pictures, answered by the hasty teacher.
        teacher_miscount: probability that the teacher answers ``n - 1`` for ``n >= 3``.

    Returns:
        ``{"train": path, "val": path, "sft": path}``.
    """
    if not 0.0 <= teacher_miscount <= 1.0:
        raise ValueError(f"teacher_miscount must be in [0, 1], got {teacher_miscount}")
    if min(n_train, n_val, n_sft) < 0:
        raise ValueError(f"sizes must be >= 0; got {n_train}, {n_val}, {n_sft}")
    rng, teacher = random.Random(seed), random.Random(seed + 1)
    counts = [rng.randint(1, 4) for _ in range(n_train + n_val + n_sft)]
    images = [png(draw(n, rng)) for n in counts]
    train = [_row(counts[i], images[i], "train", i) for i in range(n_train)]
    val = [_row(counts[i], images[i], "val", i - n_train) for i in range(n_train, n_train + n_val)]
    sft = [{"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": images[i], "path": None}],
            "response": teacher_answer(counts[i], teacher, teacher_miscount)}
           for i in range(n_train + n_val, len(counts))]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet", "sft": out / "sft.parquet"}
    for name, rows in (("train", train), ("val", val), ("sft", sft)):
        pq.write_table(pa.Table.from_pylist(rows), paths[name])
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the count-the-shapes task (verl's multimodal schema).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=128)
    ap.add_argument("--n-sft", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher-miscount", type=float, default=0.6)
    a = ap.parse_args(argv)
    paths = make_shapes_task(a.out, n_train=a.n_train, n_val=a.n_val, n_sft=a.n_sft, seed=a.seed,
                             teacher_miscount=a.teacher_miscount)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
