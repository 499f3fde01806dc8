"""Two GRPO steps at the exact Qwen2.5-0.5B shape on 2 gloo ranks: time per phase, peak memory
per rank against the planner, tokens/s.

    python bench/real_shape.py                # ~10 min and ~16 GiB RAM on a 2-core CPU
    python bench/real_shape.py --prompt 64 --response 64    # a quicker look

Why: every other test runs a model of a few million parameters with a 100-token vocabulary.
This run uses configs/models/Qwen2.5-0.5B/config.json unchanged (vocab 151936, 24 layers,
hidden 896, GQA 14 query / 2 KV heads, tied embeddings), randomly initialised in fp32, with a
151,936-entry tokenizer (one Unicode character per id, so every sampled id decodes), prompts of
``--prompt`` tokens and responses of ``--response`` tokens (a random model almost never samples
EOS, so responses run to full length). Anything that assumes a toy size (vocab-sized tensors
kept per token, int32 index overflows, cache sizing, tokenizer round trips) shows up here.

Each rank records the growth of its resident memory over its post-import baseline while it
builds the trainer (load, FSDP2 sharding, optimizer) and runs the steps; the planner's peak for
the same config on ``cpu`` is printed beside it. Timings are the trainer's own ``timing/*``
metrics of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_CONFIG = ROOT / "configs" / "models" / "Qwen2.5-0.5B" / "config.json"
PHASES = ("reshard", "generate", "score", "logprobs", "advantage", "update", "step")


def filler_chars(n: int) -> str:
    """`n` distinct non-ASCII, non-space, non-control code points (assigned or not: a word-level
    vocabulary does not care), so a character tokenizer reaches the model's vocabulary size
    with one id per character."""
    out, cp = [], 0x4E00
    while len(out) < n:
        ch = chr(cp)
        if not (0xD800 <= cp <= 0xDFFF) and not ch.isspace() and unicodedata.category(ch) != "Cc":
            out.append(ch)
        cp += 1
    return "".join(out)


def write_model_and_data(workdir: Path, prompt_tokens: int, n_prompts: int) -> None:
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from rlhf.data.char_tokenizer import DEFAULT_CHARS, SPECIAL_TOKENS, build_char_tokenizer
    from rlhf.data.synthetic import _write_parquet, make_addition_task

    cfg = AutoConfig.from_pretrained(MODEL_CONFIG.parent)
    base = len(dict.fromkeys(DEFAULT_CHARS)) + len(SPECIAL_TOKENS)
    tok = build_char_tokenizer(DEFAULT_CHARS + filler_chars(cfg.vocab_size - base))
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    cfg.torch_dtype, cfg.use_cache = "float32", False
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(workdir / "model", safe_serialization=True)
    tok.save_pretrained(workdir / "model")
    del model

    # The addition task's rows with a long random preamble: prompts of exactly `prompt_tokens`
    # tokens after the chat template, so the bench controls the sequence length.
    import pyarrow.parquet as pq

    make_addition_task(workdir / "data", n_train=n_prompts, n_val=1, n_sft=0, seed=0)
    rows = pq.read_table(workdir / "data" / "train.parquet").to_pylist()
    rng = random.Random(0)
    vocab_chars = filler_chars(20000)
    for row in rows:
        question = row["prompt"][-1]["content"]
        rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        pad = prompt_tokens - len(tok.encode(rendered, add_special_tokens=False))
        row["prompt"][-1]["content"] = "".join(rng.choice(vocab_chars) for _ in range(pad)) + question
    _write_parquet(rows, workdir / "data" / "train.parquet")


def overrides(workdir: Path, args) -> list[str]:
    return [f"model.path={workdir / 'model'}", f"data.train_files={workdir / 'data' / 'train.parquet'}",
            "data.val_files=", f"data.max_prompt_length={args.prompt}", f"data.max_response_length={args.response}",
            f"data.train_batch_size={args.prompts}", f"rollout.n={args.rollout_n}", "model.use_remove_padding=true",
            f"model.enable_gradient_checkpointing={str(args.ac).lower()}", "actor.use_kl_loss=false",
            f"actor.ppo_mini_batch_size={args.prompts}", f"actor.ppo_micro_batch_size_per_gpu={args.micro}",
            f"actor.log_prob_micro_batch_size_per_gpu={args.micro}", "trainer.device=cpu", "trainer.logger=[]",
            f"trainer.total_training_steps={args.steps}", f"trainer.output_dir={workdir / 'run'}",
            "checkpoint.export_hf=false", "checkpoint.save_freq=-1"]


def child(workdir: Path, out: Path, args) -> None:
    import torch  # noqa: F401  (imports belong to the baseline)
    import torch.distributed as dist

    from bench.train_step import PeakRSS
    from rlhf.config.load import load_config
    from rlhf.train.trainer import RLTrainer

    cfg = load_config(None, overrides(workdir, args))
    steps = []
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        trainer = RLTrainer(cfg)
        build_s = time.perf_counter() - t0
        for step in range(1, args.steps + 1):
            steps.append(trainer.train_step(step))
    rank = dist.get_rank()
    Path(f"{out}.rank{rank}").write_text(json.dumps({"growth": mem.growth, "base": mem.base, "build_s": build_s,
                                                     "steps": steps}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (after the chat template)")
    ap.add_argument("--response", type=int, default=256, help="response tokens")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (global)")
    ap.add_argument("--rollout-n", type=int, default=2, help="responses per prompt (rollout.n)")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch per rank")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args)
        return

    from rlhf.config.load import load_config
    from rlhf.planner import plan_from_config

    with tempfile.TemporaryDirectory() as d:
        workdir, out = Path(d), Path(d) / "result"
        t0 = time.perf_counter()
        write_model_and_data(workdir, args.prompt, n_prompts=max(args.prompts * args.steps, 8))
        print(f"[real_shape] wrote model + data in {time.perf_counter() - t0:.0f} s", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.ranks)),
                   PYTHONPATH=str(ROOT))
        # (--rollout-n, not --n: torchrun's parser would take --n as an abbreviation of its own flags)
        forwarded = sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))]
                         for k in ("prompt", "response", "prompts", "rollout_n", "micro", "steps")), [])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               str(Path(__file__).resolve()), "--child", str(workdir), str(out), *forwarded,
               *(["--ac"] if args.ac else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"[real_shape] training run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.ranks)]
        plan = plan_from_config(load_config(None, overrides(workdir, args)), world_size=args.ranks, device="cpu")

    steps = ranks[0]["steps"]
    result = {
        "model": "Qwen2.5-0.5B shape (random fp32)", "params_M": round(plan.shape.num_params() / 1e6, 1),
        "ranks": args.ranks, "prompt_tokens": args.prompt, "response_tokens": args.response,
        "sequences_per_step": args.prompts * args.rollout_n, "activation_checkpointing": args.ac,
        "build_s": round(ranks[0]["build_s"], 1),
        "seconds_per_phase": [{p: round(s.get(f"timing/{p}", float("nan")), 2) for p in PHASES} for s in steps],
        "tokens_per_s": [round(s["perf/tokens_per_s"], 1) for s in steps],
        "response_length_mean": [s.get("response_length/mean") for s in steps],
        "measured_peak_MiB_per_rank": [round(r["growth"] / 2 ** 20) for r in ranks],
        "planned_peak_MiB": round(plan.peak / 2 ** 20), "planned_peak_phase": plan.peak_phase,
        "measured_over_planned": round(max(r["growth"] for r in ranks) / plan.peak, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
