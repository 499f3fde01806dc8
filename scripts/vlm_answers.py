"""Draw a few images of a vision-language task with each model's greedy answer (transformers' generate).

    python scripts/vlm_answers.py --data data/shapes/val.parquet --out answers.png \
        --model "after SFT=outputs/quickstart_vlm/sft/hf_export" \
        --model "after GRPO=outputs/quickstart_vlm/grpo/hf_export"

Rows of verl's multimodal schema (``prompt``, ``images``, ``reward_model.ground_truth``); the first
``--n`` rows whose ground truths cycle through the task's answers, so every answer is shown. One
column per image: the picture, the truth, and each model's answer (green right, red wrong).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlhf.data.multimodal import decode_image, expand_placeholders  # noqa: E402
from rlhf.models.processor import load_processor  # noqa: E402


def pick(rows: list[dict], n: int) -> list[dict]:
    """``n`` rows whose ground truths take turns (1, 2, 3, 4, 1, ...), in file order."""
    truths = sorted({r["reward_model"]["ground_truth"] for r in rows})
    queues = {t: [r for r in rows if r["reward_model"]["ground_truth"] == t] for t in truths}
    out = []
    while len(out) < n and any(queues.values()):
        for t in truths:
            if queues[t] and len(out) < n:
                out.append(queues[t].pop(0))
    return out


@torch.no_grad()
def answers(model_dir: str, rows: list[dict], base: Path, max_new_tokens: int) -> list[str]:
    from transformers import AutoModelForImageTextToText

    proc = load_processor(model_dir, key="--model")
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    tok = proc.tokenizer
    out = []
    for r in rows:
        pics = [decode_image(x, base) for x in r["images"]]
        text = expand_placeholders(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                                   len(pics))
        inputs = proc(text=[text], images=pics, return_tensors="pt")
        ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", action="append", required=True, help="LABEL=DIR (repeat)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    a = ap.parse_args(argv)
    rows = pick(pq.read_table(a.data).to_pylist(), a.n)
    models = [m.split("=", 1) for m in a.model]
    said = {label: answers(d, rows, Path(a.data).parent, a.max_new_tokens) for label, d in models}
    fig, axes = plt.subplots(1, len(rows), figsize=(1.6 * len(rows), 1.9 + 0.3 * len(models)), squeeze=False)
    for ax, i in zip(axes[0], range(len(rows))):
        truth = rows[i]["reward_model"]["ground_truth"]
        ax.imshow(decode_image(rows[i]["images"][0], Path(a.data).parent), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"truth {truth}", fontsize=9)
        for k, (label, _) in enumerate(models):
            got = said[label][i].replace("####", "").strip() or said[label][i]
            ax.text(0.5, -0.12 - 0.17 * k, f"{label}: {got}", transform=ax.transAxes, ha="center", va="top",
                    fontsize=8, color="green" if got == truth else "red")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110, bbox_inches="tight")
    for label, _ in models:
        truths = [r["reward_model"]["ground_truth"] for r in rows]
        right = sum(s.replace("####", "").strip() == t for s, t in zip(said[label], truths))
        print(f"{label}: {right}/{len(rows)} right on the pictured rows")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
