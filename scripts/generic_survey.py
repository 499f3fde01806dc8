"""Survey: run every generic-path family of transformers on a tiny random config and compare with HF.

For each ``model_type`` that ``rlhf.models.generic.classify`` puts on the generic path, its default config
is shrunk (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 64, through the config's ``attribute_map``),
built with random fp32 weights, and the sampler's greedy tokens and log-probs (generic path) are compared
with HF ``generate`` / forward on three prompts (in one process; ``--isolate``: one subprocess per family,
``--timeout`` each). Prints one
line per family (``equal``, ``differs`` or ``error: ...``) and, last, a JSON object {model_type: result}.

Usage: ``python scripts/generic_survey.py [--only granite,gpt2] [--isolate --timeout 120]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
             bos_token_id=None, moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
             num_experts_per_tok=2, vocab_size_per_layer_input=64, hidden_size_per_layer_input=16,
             global_head_dim=32, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, n_group=1, topk_group=1, is_decoder=True, tie_word_embeddings=False)


def one(model_type: str) -> str:
    import torch
    import transformers

    from rlhf.rollout.sampler import Sampler
    from rlhf.rollout.sampling import SamplingParams

    base = transformers.AutoConfig.for_model(model_type)
    towers = [k for k in ("vision_config", "audio_config", "vq_config", "vision_tower_config", "depth_decoder_config")
              if getattr(base, k, None) is not None]
    if towers:  # default-size vision / audio towers take GBs on CPU: the survey runs text LMs only
        return f"skipped: multimodal ({', '.join(towers)})"
    kw = {k: v for k, v in SMALL.items() if hasattr(base, k) or k in getattr(base, "attribute_map", {})}
    config = transformers.AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "eager"  # the reference every family has
    with torch.device("meta"):  # a config the shrinking missed (a nested text_config) would take GBs
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > 20_000_000:
        return f"skipped: its config did not shrink ({size / 1e6:.0f}M parameters)"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if ("norm" in name or "ln" in name) else p.normal_(0, 0.1)
    s = Sampler(config, {k: v.clone() for k, v in model.state_dict().items()}, pad_token_id=0, max_num_seqs=4,
                dtype=torch.float32)
    assert s.backend.__name__ == "rlhf.rollout.generic"
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    out = s.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=8, stop_token_ids=[]))
    worst = 0.0
    for i, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):]
        if out.response_ids[i].tolist() != ref.tolist():
            return "differs (greedy tokens)"
        ids = torch.cat([torch.tensor(p), ref])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(p) - 1:-1].gather(1, ref[:, None])[:, 0]
        worst = max(worst, float((lp - out.log_probs[i]).abs().max()))
    return "equal" if worst <= 1e-5 else f"differs (log-probs by {worst:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--timeout", type=int, default=120, help="per family, with --isolate")
    ap.add_argument("--isolate", action="store_true", help="one subprocess per family")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        try:
            print("RESULT " + one(a.one))
        except Exception as e:  # noqa: BLE001 - a survey reports every family's failure and goes on
            print("RESULT error: " + f"{type(e).__name__}: {e}".splitlines()[0][:160])
        return
    from rlhf.models.generic import GENERIC, _causal_lm_names, classify

    types = a.only.split(",") if a.only else [t for t in sorted(_causal_lm_names()) if classify(t)[0] == GENERIC]
    results = {}
    for t in types:
        if a.isolate:  # one subprocess per family: a hang or crash costs only that family
            env = dict(os.environ, OMP_NUM_THREADS="1")
            try:
                r = subprocess.run([sys.executable, __file__, "--one", t], capture_output=True, text=True,
                                   timeout=a.timeout, env=env)
                line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                results[t] = line[-1][7:] if line else f"error: exit {r.returncode}"
            except subprocess.TimeoutExpired:
                results[t] = f"error: over {a.timeout} s"
        else:
            try:
                results[t] = one(t)
            except Exception as e:  # noqa: BLE001 - a survey reports every family's failure and goes on
                results[t] = "error: " + f"{type(e).__name__}: {e}".splitlines()[0][:160]
        print(f"{t}: {results[t]}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
