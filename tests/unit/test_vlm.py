"""Vision-language models: our M-RoPE equals transformers' ``get_rope_index``, our trainer log-probs
(padded and packed) equal transformers' own forward, and images in verl's schema stay with their rows.

Tiny random Qwen2.5-VL and Qwen3-VL (``rlhf.models.tiny_vlm``), built once per module.
"""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from rlhf.data.dataset import load_prompt_dataset  # noqa: E402
from rlhf.data.multimodal import QWEN_IMAGE_TEXT as IMG, collate_multi_modal  # noqa: E402
from rlhf.models.logprobs import forward_log_probs, token_log_probs  # noqa: E402
from rlhf.models.mrope import MRopeSpec, mrope_position_ids  # noqa: E402
from rlhf.models.packed import packed_forward_log_probs  # noqa: E402
from rlhf.models.tiny_vlm import FAMILIES, build_tiny_vlm  # noqa: E402
from rlhf.schema.batch import PromptBatch, RolloutBatch  # noqa: E402


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request):
    return build_tiny_vlm(request.param)


def _images(g: torch.Generator, sizes=((20, 28), (32, 32), (40, 16))) -> list:
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()) for h, w in sizes]


def _mixed_batch(proc, R: int = 5):
    """A left-padded mixed batch (one image / text only / two images at the start) + right-padded responses."""
    g = torch.Generator().manual_seed(0)
    texts = [f"<|user|>what {IMG} is 2+2?<|assistant|>", "<|user|>hi<|assistant|>", f"{IMG}{IMG}x<|assistant|>"]
    out = proc(text=texts, images=_images(g), padding=True, padding_side="left", return_tensors="pt",
               return_mm_token_type_ids=True)
    B = out["input_ids"].shape[0]
    resp = torch.randint(10, 60, (B, R), generator=g)
    rmask = torch.ones(B, R, dtype=torch.long)
    rmask[1, 3:] = 0  # a short response: pad inside the batch
    resp[1, 3:] = 0
    ids = torch.cat([out["input_ids"], resp], 1)
    am = torch.cat([out["attention_mask"], rmask], 1)
    types = torch.cat([out["mm_token_type_ids"], torch.zeros(B, R, dtype=torch.long)], 1)
    return ids, am, types, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def test_mrope_equals_transformers_get_rope_index(vlm):
    model, proc = vlm
    ids, am, types, mm = _mixed_batch(proc)
    ref, ref_delta = model.model.get_rope_index(ids, types, mm["image_grid_thw"], attention_mask=am)
    ours, delta = mrope_position_ids(ids, am, mm["image_grid_thw"], MRopeSpec.from_config(model.config))
    assert torch.equal(ours, ref)
    assert torch.equal(delta, ref_delta.flatten())
    assert not torch.equal(ours[1], ours[2])  # images do move h and w apart from t: the test sees 3D positions
    # a prompt cut inside an image no longer matches its grid: refused, never guessed
    with pytest.raises(ValueError, match="image 0"):
        mrope_position_ids(ids[:, :8], am[:, :8], mm["image_grid_thw"], MRopeSpec.from_config(model.config))


def test_vlm_log_probs_equal_transformers_padded_and_packed(vlm):
    model, proc = vlm
    ids, am, types, mm = _mixed_batch(proc)
    R = 5
    P = ids.shape[1] - R
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=am, mm_token_type_ids=types, **mm).logits
        model.model.rope_deltas = None  # transformers caches the deltas of its own call
        ref, _ = token_log_probs(ref_logits[:, P - 1:-1], ids[:, P:])
        padded, _ = forward_log_probs(model, ids, am, response_length=R, multi_modal=mm)
        packed, _ = packed_forward_log_probs(model, ids, am, response_length=R, multi_modal=mm)
        blind, _ = forward_log_probs(model, ids, am, response_length=R)  # no images: must differ
    m = am[:, P:].bool()
    torch.testing.assert_close(padded[m], ref[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[m], ref[m], atol=1e-5, rtol=0)
    assert (blind[m] - ref[m]).abs().max() > 1e-2


def test_images_in_verl_schema_are_processed_filtered_and_kept_per_row(tmp_path):
    from rlhf.models.tiny_vlm import build_processor, build_vlm_tokenizer

    proc = build_processor(build_vlm_tokenizer())
    g = torch.Generator().manual_seed(1)
    pics = _images(g, ((16, 16), (32, 24)))
    pics[0].save(tmp_path / "a.png")
    buf = io.BytesIO()
    pics[1].save(buf, format="PNG")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [
        {"prompt": [{"role": "user", "content": "<image>What is drawn?"}], "images": ["a.png"], "answer": "1"},
        {"prompt": "no image here", "answer": "2"},
        {"prompt": "<image> and <image>", "images": [{"path": "a.png"}, {"bytes": buf.getvalue()}], "answer": "3"},
        {"prompt": "two placeholders <image><image>", "images": ["a.png"], "answer": "4"},  # malformed: counted
        {"prompt": "long <image>" + "x" * 40, "images": ["a.png"], "answer": "5"},  # only its text can go
        {"prompt": "x" * 46 + "<image> cut", "images": ["a.png"], "answer": "6"},  # its image would be cut
    ]
    # parquet, as verl's preprocessing writes it: images as {"bytes", "path"} structs or paths
    for r in rows:
        r["images"] = [x if isinstance(x, dict) else {"path": x} for x in r.get("images", [])]
        r["images"] = [{"bytes": x.get("bytes"), "path": x.get("path")} for x in r["images"]]
        r["prompt"] = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    ds = load_prompt_dataset(f, proc.tokenizer, processor=proc, max_prompt_length=48, truncation="right",
                             filter_overlong_prompts=False)
    assert ds.stats.n_malformed == 1 and "placeholder" in ds.stats.malformed_examples[0]
    assert ds.stats.n_image_cut == 1 and ds.stats.n_truncated == 1
    assert [e.ground_truth for e in ds.examples] == ["1", "2", "3", "5"]
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for e in ds.examples:
        n_tokens = sum(t == image_id for t in e.prompt_ids)
        if e.multi_modal is None:
            assert n_tokens == 0
        else:  # one image token per merged patch: the prompt matches its pixel_values
            assert n_tokens == int(e.multi_modal["image_grid_thw"].prod(-1).sum()) // 4 > 0
            assert e.multi_modal["pixel_values"].shape[0] == int(e.multi_modal["image_grid_thw"].prod(-1).sum())
    assert ds.examples[2].multi_modal["image_grid_thw"].shape[0] == 2

    # rows keep their images through subset / select / concat (micro-batches, regrouping)
    pb = PromptBatch(prompt_ids=[e.prompt_ids for e in ds.examples], keys=[0, 1, 2, 3], ground_truths=["1"] * 4,
                     data_sources=["s"] * 4, extra_infos=[{}] * 4, multi_modal=[e.multi_modal for e in ds.examples])
    assert pb.subset([2, 1]).multi_modal[0] is ds.examples[2].multi_modal

    def rollout(n, mm):
        z = torch.zeros(n, 3)
        return RolloutBatch(input_ids=z.long(), attention_mask=z.long(), responses=z.long(), response_mask=z,
                            index=torch.arange(n), rollout_log_probs=z, truncated=torch.zeros(n, dtype=torch.bool),
                            multi_modal=mm)

    both = RolloutBatch.concat([rollout(2, []), rollout(4, [e.multi_modal for e in ds.examples])])
    assert both.multi_modal[:3] == [None, None, ds.examples[0].multi_modal]
    picked = both.select([5, 2, 1])
    assert picked.multi_modal == [ds.examples[3].multi_modal, ds.examples[0].multi_modal, None]
    col = collate_multi_modal(picked.multi_modal)
    assert torch.equal(col["image_grid_thw"], torch.cat([ds.examples[3].multi_modal["image_grid_thw"],
                                                         ds.examples[0].multi_modal["image_grid_thw"]]))
    assert collate_multi_modal([None, None]) is None


def test_lora_on_a_vlm_adapts_the_language_model_only():
    from rlhf.models.lora import apply_lora

    model, _ = build_tiny_vlm("qwen2_5_vl")
    peft_model = apply_lora(model, lora_rank=4, lora_alpha=8)
    adapted = [n for n, _ in peft_model.named_parameters() if "lora_A" in n]
    assert adapted and all(".visual." not in n for n in adapted)
    assert any(".language_model." in n for n in adapted)


def test_prepare_geo3k_keeps_images_and_loads_with_the_processor(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf.data.prepare import prepare
    from rlhf.models.tiny_vlm import build_processor, build_vlm_tokenizer

    buf = io.BytesIO()
    _images(torch.Generator().manual_seed(2), ((16, 16),))[0].save(buf, format="PNG")
    img = {"bytes": buf.getvalue(), "path": None}
    raw = [{"problem": "<image>Find x.", "answer": "3", "images": [img]},
           {"problem": "Find y.", "answer": "4", "images": [img]},  # placeholder missing: skipped, counted
           {"problem": "<image>Find z.", "answer": "5", "images": [img]}]
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "train.parquet")
    report = prepare("geo3k", [str(tmp_path / "train.parquet")], str(tmp_path / "out"))
    assert sum(report.written.values()) == 2 and sum(report.skipped.values()) == 1
    proc = build_processor(build_vlm_tokenizer())
    ds = load_prompt_dataset(tmp_path / "out" / "train.parquet", proc.tokenizer, processor=proc, max_prompt_length=400)
    assert len(ds) == 2 and all(e.multi_modal is not None for e in ds.examples)
    assert ds.examples[0].data_source == "hiyouga/geometry3k" and ds.examples[1].ground_truth == "5"
    assert "\\boxed{}" in ds.examples[0].prompt_text and "<image>" not in ds.examples[0].prompt_text
