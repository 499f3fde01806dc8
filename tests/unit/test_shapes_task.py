"""The vision-language quickstart's task and its warm start: a picture holds as many shapes as its
ground truth says (lit grid cells), the hasty teacher undercounts only crowded pictures at its rate,
and SFT on a VLM reads the rows' images (the loss of the same text with another picture differs)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("PIL")

from rlhf.data.shapes import CELL, draw, make_shapes_task, teacher_answer  # noqa: E402


def _lit_cells(im) -> int:
    px = torch.tensor(list(im.getdata())).view(32, 32, 3).sum(-1) > 0
    return sum(bool(px[y:y + CELL, x:x + CELL].any()) for y in (0, CELL) for x in (0, CELL))


def test_pictures_hold_their_count_and_the_teacher_undercounts_crowded_ones():
    rng = random.Random(0)
    for n in (1, 2, 3, 4) * 5:
        assert _lit_cells(draw(n, rng)) == n
    t = random.Random(1)
    said = {n: [teacher_answer(n, t, 0.6) for _ in range(2000)] for n in (1, 2, 3, 4)}
    assert set(said[1]) == {"#### 1"} and set(said[2]) == {"#### 2"}
    for n in (3, 4):
        wrong = sum(s == f"#### {n - 1}" for s in said[n]) / len(said[n])
        assert abs(wrong - 0.6) < 0.05 and set(said[n]) == {f"#### {n}", f"#### {n - 1}"}


def test_task_files_are_verl_multimodal_rows(tmp_path):
    import pyarrow.parquet as pq

    from rlhf.data.multimodal import decode_image

    paths = make_shapes_task(tmp_path, n_train=8, n_val=4, n_sft=8)
    val = pq.read_table(paths["val"]).to_pylist()
    assert len(val) == 4 and val[0]["prompt"][0]["content"].count("<image>") == 1
    for row in val:
        assert _lit_cells(decode_image(row["images"][0])) == int(row["reward_model"]["ground_truth"])
    sft = pq.read_table(paths["sft"]).to_pylist()
    assert len(sft) == 8 and all(r["response"].startswith("#### ") and r["images"] for r in sft)


def test_sft_on_a_vlm_reads_the_images(tmp_path):
    from rlhf.data.shapes import QUESTION, png
    from rlhf.models.tiny_vlm import build_tiny_vlm
    from rlhf.train.sft import SFTSettings, sft_loss, tokenize_sft

    model, proc = build_tiny_vlm("qwen2_5_vl")
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": png(draw(n, rng)), "path": None}],
             "response": "#### 2"} for n in (1, 4)]
    rows.append({"prompt": "text only", "response": "#### 2"})
    rows.append({"prompt": [{"role": "user", "content": QUESTION + "<image>"}], "images": rows[0]["images"],
                 "response": "#### 2"})
    data, stats = tokenize_sft(rows, proc.tokenizer, SFTSettings(train_files=str(tmp_path / "sft.parquet")), proc)
    # two "<image>" placeholders for one image: skipped and counted
    assert stats["n_loaded"] == 3 and stats["n_malformed"] == 1
    assert data[0][3]["image_grid_thw"].tolist() == [[1, 8, 8]] and data[2][3] is None
    assert data[0][0] == data[1][0]  # the same prompt tokens: only the pictures differ
    n = torch.tensor(7.0)
    with torch.no_grad():
        a, b = (sft_loss(model, [e], proc.tokenizer.pad_token_id, n, torch.device("cpu"), packed=True)
                for e in data[:2])
        both = sft_loss(model, data[:2], proc.tokenizer.pad_token_id, n, torch.device("cpu"), packed=False)
    assert abs(a - b) > 1e-3  # the picture changes the loss: the vision tower is in the forward
    torch.testing.assert_close(both, a + b, rtol=1e-5, atol=1e-5)  # padded batch == packed rows
