"""Tiny model and task directories the multi-process and end-to-end tests build (no downloads)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_assets(d: Path, *, num_layers: int = 2, n_train: int = 64, n_val: int = 16, n_sft: int = 0) -> Path:
    """`d/model` (hidden 32, 4 heads, 2 kv heads, char tokenizer) and `d/data` (the addition task)."""
    from rlhf.data.synthetic import make_addition_task
    from rlhf.models.tiny import write_tiny_model

    write_tiny_model(str(d / "model"), hidden_size=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
    make_addition_task(d / "data", n_train=n_train, n_val=n_val, n_sft=n_sft, seed=0)
    return d


TOOL_CONFIG = "tools:\n  - class_name: calculator\n"


def write_tool_assets(d: Path, *, steps: int = 100, n_demos: int = 16, seed: int = 0) -> Path:
    """`write_tiny_assets` plus `d/tools.yaml` (the calculator) and `d/tool_model`: the tiny model
    fitted (as train_sft.py fits, loss off the tool results) on multi-turn calculator
    demonstrations of the addition prompts (a call, the tool's answer, `#### <sum>`), so that
    sampling from it calls the tool, sometimes wrongly."""
    import torch
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.arithmetic import tool_call
    from rlhf.train.sft import SFTSettings, sft_loss, tokenize_sft

    write_tiny_assets(d, n_train=64, n_val=16)
    (d / "tools.yaml").write_text(TOOL_CONFIG)
    tok = AutoTokenizer.from_pretrained(d / "model")
    rows = []
    for row in pq.read_table(d / "data" / "train.parquet").to_pylist()[:n_demos]:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        answer = str(int(a) + int(b))
        rows.append({"prompt": row["prompt"], "response": [
            {"role": "assistant", "content": tool_call(f"{a}+{b}")}, {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"#### {answer}"}]})
    examples, _ = tokenize_sft(rows, tok, SFTSettings(max_length=256))
    n_tok = torch.tensor(float(sum(sum(e[2]) for e in examples)))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(d / "model")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = sft_loss(model, examples, tok.pad_token_id, n_tok, torch.device("cpu"), packed=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(d / "tool_model")
    tok.save_pretrained(d / "tool_model")
    return d


def write_tool_vlm_assets(d: Path, *, steps: int = 60, n_rows: int = 8, seed: int = 0) -> Path:
    """`d/tool_vlm` (a tiny random Qwen2.5-VL fitted, as `write_tool_assets`, on calculator demos of
    `<image>a+b=` prompts with random pictures), `d/tools.yaml` and `d/train.parquet`: `n_rows` addition
    prompts (verl's multimodal schema), in pairs: two with a picture, then two text-only (unshuffled batches
    of 4 on 2 ranks give one rank only image prompts and the other only text ones)."""
    import io
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    from rlhf.data.arithmetic import tool_call
    from rlhf.models.tiny_vlm import build_tiny_vlm
    from rlhf.train.sft import SFTSettings, sft_loss, tokenize_sft

    d.mkdir(parents=True, exist_ok=True)
    (d / "tools.yaml").write_text(TOOL_CONFIG)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, demos = [], []
    for i in range(n_rows):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        images = []
        if i % 4 < 2:
            buf = io.BytesIO()
            Image.fromarray((torch.rand(16, 16 + 8 * (i % 4), 3, generator=g) * 255).byte().numpy()).save(buf, "PNG")
            images = [{"bytes": buf.getvalue(), "path": None}]
        prompt = [{"role": "user", "content": ("<image>" if images else "") + f"{a}+{b}="}]
        rows.append({"prompt": prompt, "images": images, "data_source": "arith",
                     "reward_model": {"ground_truth": str(a + b)}})
        demos.append({"prompt": prompt, "images": images, "response": [
            {"role": "assistant", "content": tool_call(f"{a}+{b}")}, {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"#### {a + b}"}]})
    pq.write_table(pa.Table.from_pylist(rows), d / "train.parquet")
    model, proc = build_tiny_vlm("qwen2_5_vl", seed=seed, init_std=None)
    examples, _ = tokenize_sft(demos, proc.tokenizer, SFTSettings(max_length=256, train_files=str(d / "x")), proc)
    n_tok = torch.tensor(float(sum(sum(e[2]) for e in examples)))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra intra-op threads only contend (10x slower on a loaded CPU)
    try:
        for _ in range(steps):
            loss = sft_loss(model, examples, proc.tokenizer.pad_token_id, n_tok, torch.device("cpu"), packed=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(d / "tool_vlm")
    proc.save_pretrained(d / "tool_vlm")
    return d


def digit_pair_tokenizer(pairs_of: str = "0123456789"):
    """A second tokenizer for the addition task, built with the `tokenizers` library: every two-character
    string of ``pairs_of`` (default: two digits) is one token (greedy longest match), other characters and
    the special tokens as the project's char tokenizer has them; its vocabulary differs from the student's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhf.data.char_tokenizer import DEFAULT_CHARS, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for piece in list(DEFAULT_CHARS) + [a + b for a in pairs_of for b in pairs_of]:
        vocab.setdefault(piece, len(vocab))
    tk = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix="", max_input_chars_per_word=100))
    tk.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=list(SPECIAL_TOKENS[3:]))


def write_digit_pair_teacher(d: Path, *, seed: int = 3, pairs_of: str = "0123456789") -> Path:
    """A random tiny model with :func:`digit_pair_tokenizer` (a teacher for the cross-tokenizer path)."""
    from transformers import Qwen2ForCausalLM

    import torch

    from rlhf.models.tiny import tiny_qwen2_config

    tok = digit_pair_tokenizer(pairs_of)
    torch.manual_seed(seed)
    cfg = tiny_qwen2_config(len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d
