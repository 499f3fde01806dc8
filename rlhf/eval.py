"""Evaluate a checkpoint: sample n responses per prompt, score them, print pass@k / maj@k.

    python -m rlhf.eval --model DIR --data test.parquet --n 16 --temperature 0.6 --max-new-tokens 1024
    torchrun --nproc_per_node=8 -m rlhf.eval --model DIR --data a.parquet b.parquet --num-samples 16 --out evals/x

Prompts are dealt to ranks round-robin; generation uses the training run's sampler, keyed by
(seed, prompt index, sample), so the generations and the numbers do not depend on the number
of ranks. Metrics (rlhf.train.evaluation): pass@1 (mean over samples), unbiased pass@k (Chen et al.
2021), maj@k (needs a reward that returns ``pred``, e.g. ``math``), mean response length and
truncation rate, per data_source and over all. ``--out DIR`` writes ``summary.json`` and
``generations.jsonl`` (one row per sample).

A policy trained with tools (``rollout.multi_turn``) is evaluated with them:
``--tool-config configs/tools/calculator.yaml`` lists the tools in the prompt's chat template and
runs the same agent loop as training (``--max-assistant-turns``, ``--max-tool-response-length``,
verl's names); the summary then carries the tool-use metrics (``agent/tool_calls_per_traj``, ...).

A vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL saved with its processor, as the training
exports are) reads the rows' images (``--image-key``, verl's multimodal schema) and samples with them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlhf.schema.config import ConfigError, MultiTurnConfig, RolloutConfig


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory, cached hub name, or a training checkpoint "
                                                   "(<output_dir>/checkpoints/global_step_N)")
    ap.add_argument("--data", required=True, nargs="+", help="parquet/jsonl files in verl's schema")
    ap.add_argument("--n", "--num-samples", dest="n", type=int, default=1,
                    help="samples per prompt (under torchrun spell it --num-samples: torchrun takes --n itself)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (needs --n 1)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--max-prompt-length", type=int, default=1024)
    ap.add_argument("--reward", default="default", help="reward function name or file.py:function")
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--no-chat-template", action="store_true", help="prompts are plain text")
    ap.add_argument("--image-key", default="images", help="images column of a vision-language model's data")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    ap.add_argument("--out", default="", help="directory for summary.json and generations.jsonl")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bf16 on CUDA")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the sampler")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="concurrent sequences per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward-workers", type=int, default=4, help="reward processes per rank (0: in-process)")
    ap.add_argument("--reward-timeout", type=float, default=30.0, help="seconds per reward call; then it scores 0")
    tools = MultiTurnConfig()
    ap.add_argument("--tool-config", default="", help="tools yaml (rollout.multi_turn.tool_config_path): "
                                                      "multi-turn generation with these tools")
    ap.add_argument("--max-assistant-turns", type=int, default=tools.max_assistant_turns)
    ap.add_argument("--max-tool-response-length", type=int, default=tools.max_tool_response_length,
                    help="characters of a tool result kept")
    ap.add_argument("--tool-workers", type=int, default=tools.num_workers, help="tool processes per rank")
    ap.add_argument("--tool-timeout", type=float, default=tools.tool_timeout_s, help="seconds per tool call")
    args = ap.parse_args(argv)
    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.n > 1 and args.temperature <= 0:
        raise ConfigError(f"--n {args.n} with greedy decoding gives identical samples; set --temperature > 0")
    return args


def model_processor(model_dir: str):
    """The processor saved with a vision-language model (Qwen-VL), None for a text LM."""
    from rlhf.models.loading import model_config
    from rlhf.models.mrope import is_vlm_config
    from rlhf.models.processor import load_processor

    return load_processor(model_dir, key="--model") if is_vlm_config(model_config(model_dir)) else None


def evaluate(args: argparse.Namespace) -> dict:
    """Run the evaluation on every rank; rank 0 returns ``{"summary", "generations"}`` (others: {})."""
    import torch

    from rlhf.agent.rollout import make_agent
    from rlhf.agent.tools import load_tool_config, tool_schemas
    from rlhf.data.dataset import load_prompt_dataset
    from rlhf.export import hf_model_dir
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.models.parallel import all_gather_object, init_distributed
    from rlhf.rewards.pool import make_scorer
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.rollout.reshard import RolloutLayout
    from rlhf.schema.batch import PromptBatch
    from rlhf.train.evaluation import format_table, score_batch, summarize

    env = init_distributed(args.device)
    # checked before any work: every failure is one line naming --tool-config
    tools = tool_schemas(load_tool_config(args.tool_config, "--tool-config")) if args.tool_config else None
    dtype = args.dtype or ("bfloat16" if env.device.type == "cuda" else "float32")
    try:
        scorer = make_scorer(args.reward, num_workers=args.reward_workers, timeout_s=args.reward_timeout)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--reward: {e}") from None
    with hf_model_dir(args.model) as model_dir:  # a checkpoint dir is exported to a temporary directory
        tokenizer = load_tokenizer(model_dir, key="--model")
        processor = model_processor(model_dir)  # a VLM: its prompts' images are read and sampled with
        # kept on the host: the engine slices it for --tp and the sampler moves only this rank's
        # slices to the device (moving the whole model first cost a full copy per GPU at any tp)
        model = load_causal_lm(model_dir, dtype=dtype, key="--model").eval()
    multi_turn = MultiTurnConfig(enable=bool(args.tool_config), tool_config_path=args.tool_config,
                                 max_assistant_turns=args.max_assistant_turns,
                                 max_tool_response_length=args.max_tool_response_length,
                                 num_workers=args.tool_workers, tool_timeout_s=args.tool_timeout)
    ds = load_prompt_dataset(args.data, tokenizer, prompt_key=args.prompt_key, max_prompt_length=args.max_prompt_length,
                             truncation="error", filter_overlong_prompts=True,
                             apply_chat_template=not args.no_chat_template, tools=tools, processor=processor,
                             image_key=args.image_key)
    if env.is_main:
        print(f"[rlhf.eval] {ds.stats.summary()}", flush=True)
    n_prompts = min(len(ds), args.limit) if args.limit > 0 else len(ds)
    mine = [ds[i] for i in range(env.rank, n_prompts, env.world_size)]
    prompts = PromptBatch(prompt_ids=[e.prompt_ids for e in mine], keys=[e.index for e in mine],
                          ground_truths=[e.ground_truth for e in mine], data_sources=[e.data_source for e in mine],
                          extra_infos=[e.extra_info for e in mine],
                          multi_modal=[e.multi_modal for e in mine] if processor is not None else [])
    rcfg = RolloutConfig(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, tp=args.tp,
                         max_num_seqs=args.max_num_seqs, seed=args.seed)
    layout = RolloutLayout.build(args.tp, env.device.type)
    engine = RolloutEngine(rcfg, tokenizer, max_prompt_length=args.max_prompt_length,
                           max_response_length=args.max_new_tokens, device=env.device, dtype=model.dtype, layout=layout)
    agent = make_agent(multi_turn, tokenizer, layout)
    turns = agent.turns() if agent is not None else None
    t0 = time.perf_counter()
    with torch.no_grad():
        batch, _ = engine.generate(model, model.config, prompts, step=0, n=args.n, temperature=args.temperature,
                                   turns=turns)
    seconds = time.perf_counter() - t0
    tool_use = agent.metrics(batch, turns) if agent is not None else {}  # global: every rank takes part
    if agent is not None:
        agent.close()
    records = score_batch(scorer, batch)
    scorer.close()
    text_by_key = {e.index: e.prompt_text for e in mine}
    rows = [{**r.to_dict(), "prompt": text_by_key[r.key], "response": batch.response_texts[i],
             "ground_truth": batch.ground_truths[i]} for i, r in enumerate(records)]
    pieces = all_gather_object((records, rows), None)
    if not env.is_main:
        return {}
    records = [r for p in pieces for r in p[0]]
    rows = sorted((r for p in pieces for r in p[1]), key=lambda r: (r["data_source"], r["key"], r["sample"]))
    summary = summarize(records)
    print(format_table(summary), flush=True)
    if tool_use:
        summary["tool_use"] = tool_use  # beside the data sources in summary.json
        print("[rlhf.eval] " + ", ".join(f"{k} {v:.4g}" for k, v in tool_use.items() if "tool_errors/" not in k),
              flush=True)
    print(f"[rlhf.eval] {len(records)} samples of {n_prompts} prompts in {seconds:.2f} s on {env.world_size} rank(s)",
          flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"summary": summary, "args": vars(args),
                                                      "generate_seconds": seconds}, indent=2))
        with open(out / "generations.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"[rlhf.eval] wrote {out / 'summary.json'} and {out / 'generations.jsonl'}", flush=True)
    return {"summary": summary, "generations": rows}


def main(argv=None) -> None:
    from rlhf.cli import run_main

    run_main(lambda: evaluate(parse_args(argv)))


if __name__ == "__main__":
    main()
