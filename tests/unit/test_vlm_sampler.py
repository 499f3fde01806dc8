"""The built-in sampler on a tiny random Qwen2.5-VL / Qwen2-VL / Qwen3-VL (deepstack, interleaved
M-RoPE): greedy tokens equal transformers' ``generate``, the sampler's log-probs equal the trainer's
forward (images, M-RoPE), chunked prefill, preemption / recompute and static decode shapes give the
same tokens, and placeholder ids are never drawn."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from rlhf.data.multimodal import QWEN_IMAGE_TEXT as IMG  # noqa: E402
from rlhf.models.logprobs import forward_log_probs  # noqa: E402
from rlhf.models.tiny_vlm import build_tiny_vlm  # noqa: E402
from rlhf.rollout.sampler import Sampler  # noqa: E402
from rlhf.rollout.sampling import SamplingParams  # noqa: E402

R = 6


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def case(request):
    model, proc = build_tiny_vlm(request.param)
    g = torch.Generator().manual_seed(0)
    img = lambda h, w: Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())  # noqa: E731
    rows = [(f"<|user|>what {IMG} is 2+2?<|assistant|>", [img(20, 28)]), ("<|user|>hi<|assistant|>", None),
            (f"{IMG}{IMG}x<|assistant|>", [img(32, 32), img(40, 16)])]
    prompts, mms, types = [], [], []
    for text, images in rows:
        out = proc(text=[text], images=images, return_tensors="pt", return_mm_token_type_ids=True)
        prompts.append(out["input_ids"][0].tolist())
        mms.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
                   if images else None)
        types.append(out["mm_token_type_ids"])
    # transformers' greedy continuation of each prompt alone (no padding; it stops at EOS),
    # placeholders suppressed as the sampler does (this random model's argmax is the video token at times)
    ban = [model.config.image_token_id, model.config.video_token_id]
    ref = []
    with torch.no_grad():
        for ids, mm, tt in zip(prompts, mms, types):  # mm_token_type_ids: transformers' M-RoPE needs them
            model.model.rope_deltas = None
            out = model.generate(input_ids=torch.tensor([ids]),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 **(mm or {}), mm_token_type_ids=tt, max_new_tokens=R, do_sample=False,
                                 suppress_tokens=ban)
            ref.append(out[0, len(ids):].tolist())
    return model, proc, prompts, mms, ref


def _padded(rows: list[list[int]]) -> list[list[int]]:
    return [r + [0] * (R - len(r)) for r in rows]


def _params(n: int = 1, max_new: int = R) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_new_tokens=max_new, stop_token_ids=[1])  # the tiny EOS


def _sampler(model, **kw) -> Sampler:
    return Sampler(model.config, dict(model.state_dict()), pad_token_id=0, max_num_seqs=8, **kw)


def test_sampler_greedy_equals_hf_generate_and_log_probs_equal_the_trainer(case):
    model, _, prompts, mms, ref = case
    out = _sampler(model).generate(prompts, _params(), multi_modal=mms)
    assert out.response_ids.tolist() == _padded(ref)
    # the trainer's log-probs of the same sequences (padded forward with the images and M-RoPE)
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):P] = torch.tensor(p)
        am[i, P - len(p):P + len(ref[i])] = 1
    ids[:, P:] = out.response_ids
    mm_rows = [m for m in mms if m is not None]
    mm = {"pixel_values": torch.cat([m["pixel_values"] for m in mm_rows]),
          "image_grid_thw": torch.cat([m["image_grid_thw"] for m in mm_rows])}
    with torch.no_grad():
        trainer, _ = forward_log_probs(model, ids, am, response_length=R, multi_modal=mm)
    m = am[:, P:].bool()
    torch.testing.assert_close(out.log_probs[m], trainer[m], atol=1e-5, rtol=0)
    # chunked prefill (prefill_tokens below a prompt: the image prompts go in chunks) and n=2: same tokens
    out2 = _sampler(model, prefill_tokens=8).generate(prompts, _params(n=2), multi_modal=mms)
    assert out2.response_ids.tolist() == [r for r in _padded(ref) for _ in range(2)]
    assert out2.stats["prefill_calls"] > 3
    # a cache too small for all three to grow: the latest is preempted and recomputed (images, positions
    # and the generated tokens' text positions rebuilt), same tokens
    # (no stop token, so every row grows R tokens)
    no_stop = SamplingParams(n=1, temperature=0.0, max_new_tokens=R)
    roomy = _sampler(model).generate(prompts, no_stop, multi_modal=mms)
    assert [row[:len(r)] for row, r in zip(roomy.response_ids.tolist(), ref)] == ref
    tight = _sampler(model, kv_cache_tokens=72, block_size=4, slot_regions=False, max_seq_len=40)
    out3 = tight.generate(prompts, no_stop, multi_modal=mms)
    assert out3.stats["preemptions"] > 0 and out3.stats["recomputed_tokens"] > 0
    assert torch.equal(out3.response_ids, roomy.response_ids)
    # static decode shapes (all slots, bucketed windows: what a CUDA graph captures, rope rows from rope_buf)
    static = _sampler(model)
    static.static_shapes = True
    assert static.generate(prompts, _params(), multi_modal=mms).response_ids.tolist() == _padded(ref)


def test_sampler_never_draws_a_banned_placeholder(case):
    model, _, prompts, mms, ref = case
    s = _sampler(model)
    first = ref[0][0]
    s.banned_ids = torch.tensor([first])  # the greedy token itself: masking must move the draw
    out = s.generate(prompts[:1], _params(max_new=2), multi_modal=mms[:1])
    assert out.response_ids[0, 0].item() != first
    assert s.vlm_config.image_token_id in s.__class__(model.config, dict(model.state_dict()), pad_token_id=0,
                                                      max_num_seqs=1).banned_ids.tolist()


def test_start_up_check_reads_the_language_model_of_a_vlm():
    from rlhf.models.decoder import check_supported
    from rlhf.models.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config

    tok = build_vlm_tokenizer()
    assert check_supported(tiny_vlm_config(tok, "qwen2_5_vl"), 128).model_type == "qwen2"
    assert check_supported(tiny_vlm_config(tok, "qwen3_vl"), 128).qk_norm


def test_start_up_accepts_what_the_vlm_rollout_runs(tmp_path):
    from rlhf.models.loading import check_rollout_support
    from rlhf.models.tiny_vlm import build_vlm_tokenizer, tiny_vlm_config
    from rlhf.schema.config import ConfigError

    tiny_vlm_config(build_vlm_tokenizer(), "qwen2_5_vl").save_pretrained(tmp_path)
    check_rollout_support(str(tmp_path), max_seq_len=128)  # accepted: no refusal of the model itself
    check_rollout_support(str(tmp_path), rollout_tp=2)  # the tower runs whole on each rank of the TP group
    with pytest.raises(ConfigError, match="^data.max_response_length"):  # the language model's limit
        check_rollout_support(str(tmp_path), max_seq_len=10_000)


def test_multi_turn_on_image_prompts_resumes_on_text_positions(case):
    """A tool turn on an image prompt: the observation is prefilled at cache position + the prompt's M-RoPE
    delta (text positions after the images), so the sampler's log-probs after a resume still equal the
    trainer's forward of the whole trajectory. (Without the delta they were off by up to 2.5.)"""
    from tests.unit import test_sampler_turns as turns

    model, _, prompts, mms, _ = case
    calls = tuple(range(5, 25))  # stops frequent under the random model, so most rows take tool turns
    tool = turns.FakeTool(max_turns=2)
    n, R2 = 2, 24
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=R2, seed=3, stop_token_ids=list(calls))
    old, turns.CALLS = turns.CALLS, calls
    try:
        out = _sampler(model).generate(prompts, params, multi_modal=mms, turns=tool)
    finally:
        turns.CALLS = old
    image_rows = {i for i in range(len(prompts) * n) if mms[i // n] is not None}
    assert {row for row, _, _ in tool.log} & image_rows  # image rows took tool turns
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts) * n, P + R2, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i in range(len(ids)):
        p = prompts[i // n]
        ids[i, P - len(p):P] = torch.tensor(p)
        am[i, P - len(p):] = 1
    ids[:, P:] = out.response_ids
    mm_rows = [mms[i // n] for i in range(len(ids)) if mms[i // n] is not None]
    mm = {"pixel_values": torch.cat([m["pixel_values"] for m in mm_rows]),
          "image_grid_thw": torch.cat([m["image_grid_thw"] for m in mm_rows])}
    with torch.no_grad():
        trainer, _ = forward_log_probs(model, ids, am, response_length=R2, multi_modal=mm)
    m = (out.log_probs != 0) & ~turns._holes(tool, out)
    assert m[sorted(image_rows)].sum() > 10
    torch.testing.assert_close(out.log_probs[m], trainer[m], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_vl"], indirect=True)  # deepstack too; one family keeps it cheap
def test_stream_run_carries_each_prompts_images(case):
    """trainer.mode fully_async's StreamRun on image prompts: group slots refilled with other prompts' images
    give generate()'s tokens and log-probs; after a weight push (kv=recompute) the re-prefilled sequences use
    the new tower's features: their new tokens' log-probs equal the new model's forward with the images."""
    from rlhf.rollout.stream import STOP, StreamPrompt, StreamRun

    model, _, prompts, mms, _ = case
    other, _ = build_tiny_vlm(model.config.model_type, seed=1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=R, seed=5)
    keys = [10 + i for i in range(len(prompts))]

    class Driver:
        def __init__(self, push_at: int = -1):
            self.todo = [StreamPrompt(p, key=k, step=2, tag=i, multi_modal=mm)
                         for i, (p, k, mm) in enumerate(zip(prompts, keys, mms))]
            self.groups, self.polls, self.push_at = {}, 0, push_at

        def poll_weights(self, block):
            self.polls += 1
            if self.polls == self.push_at:
                return 1, dict(other.state_dict())
            return STOP if len(self.groups) == len(prompts) else None

        def next_prompts(self, free, version):
            out, self.todo = self.todo[:free], self.todo[free:]
            return out

        def on_group(self, prompt, out):
            self.groups[prompt.tag] = out

    ref = _sampler(model).generate(prompts, params, step=2, prompt_keys=keys, multi_modal=mms)
    plain, pushed = Driver(), Driver(push_at=4)
    for d in (plain, pushed):  # 2 group slots for 3 prompts: a slot is refilled with another prompt's images
        StreamRun(_sampler(model, max_seq_len=64), params, 2, d, max_prompt_len=48, kv="recompute").execute()
    for i in range(len(prompts)):
        g = plain.groups[i]
        assert g["response_ids"].tolist() == ref.response_ids[2 * i:2 * i + 2].tolist()
        torch.testing.assert_close(g["log_probs"], ref.log_probs[2 * i:2 * i + 2], atol=1e-5, rtol=0)
    checked = 0
    for i, p in enumerate(prompts):
        g = pushed.groups[i]
        new = g["versions"] == 1
        if not new.any():
            continue
        ids = torch.tensor([p + row.tolist() for row in g["response_ids"]])
        mm = None if mms[i] is None else {k: torch.cat([v, v]) for k, v in mms[i].items()}
        with torch.no_grad():
            want, _ = forward_log_probs(other, ids, torch.ones_like(ids), response_length=R, multi_modal=mm)
        torch.testing.assert_close(g["log_probs"][new], want[new], atol=1e-5, rtol=0)
        checked += int(new.sum()) if mms[i] is not None else 0
    assert checked > 0  # image rows sampled under the pushed weights
