"""Bad input found by the fault-injection run of issue 33: refused at start with one line naming it."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from rlhf.schema.config import ConfigError
from tests._assets import write_tiny_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_tiny_assets(tmp_path_factory.mktemp("assets"), n_train=8, n_val=4)


def test_a_model_directory_without_tokenizer_files_is_refused(assets, tmp_path):
    """transformers builds a 1-token tokenizer from config.json alone: every prompt would be []."""
    from rlhf.models.loading import load_tokenizer

    bare = tmp_path / "model"
    bare.mkdir()
    for f in (assets / "model").iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare)
    with pytest.raises(ConfigError, match=f"model.path: {bare} has no tokenizer files"):
        load_tokenizer(str(bare), key="model.path")
    # tokenizer files that give an empty vocabulary are refused too
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.path: the tokenizer in .* is empty"):
        load_tokenizer(str(bare), key="model.path")
    assert len(load_tokenizer(str(assets / "model"))("1+2=")["input_ids"]) > 0


def _save_with(assets, tmp_path, edit):
    """A copy of the tiny model with ``edit(state_dict)`` applied, saved as a HF directory."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    with torch.no_grad():
        edit(dict(m.named_parameters()))
    out = tmp_path / "edited"
    m.save_pretrained(str(out))
    for f in (assets / "model").iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out)
    return out


def test_a_nan_in_the_weights_is_named_at_load(assets, tmp_path):
    from rlhf.models.loading import load_causal_lm

    bad = _save_with(assets, tmp_path, lambda p: p["model.layers.1.mlp.up_proj.weight"].view(-1)[7].fill_(math.nan))
    with pytest.raises(ConfigError, match=r"model.path: .* weight model.layers.1.mlp.up_proj.weight holds 1 "
                                          r"non-finite value\(s\)"):
        load_causal_lm(str(bad))


def test_a_corrupt_safetensors_file_is_one_line_naming_it(assets, tmp_path):
    from rlhf.models.loading import load_causal_lm

    bad = tmp_path / "model"
    shutil.copytree(assets / "model", bad)
    f = bad / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + f.read_bytes()[30:])
    with pytest.raises(ConfigError, match=f"model.path: cannot read the weights in {bad} \\(model.safetensors\\)"):
        load_causal_lm(str(bad))


@pytest.mark.parametrize("top_k", [-1, 5])
def test_nan_logits_do_not_crash_the_sampler_and_the_rollout_names_them(top_k):
    """A NaN row used to draw index V (out of bounds); now it draws in range with a NaN log-prob, which
    the rollout batch reports as one NonFiniteError instead of validation scoring 0 silently."""
    from rlhf.rollout.sampling import SamplingParams, sample_next

    logits = torch.randn(3, 11)
    logits[1] = math.nan
    tok, lp = sample_next(logits, SamplingParams(top_k=top_k), torch.full((3,), 0.5))
    assert int(tok.max()) < 11 and bool(lp[1].isnan()) and bool(lp[[0, 2]].isfinite().all())


def test_rollout_batch_with_nan_log_probs_is_a_nonfinite_error():
    from rlhf.schema.config import RolloutConfig
    from rlhf.data.char_tokenizer import build_char_tokenizer
    from rlhf.train.optim import NonFiniteError
    from rlhf.rollout.engine import PromptBatch, RolloutEngine
    from tests.unit.test_sampler import _model

    m = _model()
    prompts = PromptBatch(prompt_ids=[[1, 2, 3], [4, 5]], keys=[0, 1], ground_truths=["", ""], data_sources=["x"] * 2,
                          extra_infos=[{}] * 2)
    engine = RolloutEngine(RolloutConfig(n=2, seed=3), build_char_tokenizer(), max_prompt_length=8,
                           max_response_length=6, device=torch.device("cpu"))
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    weights["lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"][3, 0] = math.nan
    with pytest.raises(NonFiniteError, match="rollout: the policy's logits are not finite"):
        engine.sample(weights, m.config, prompts, step=1, n=2, temperature=1.0)


@pytest.mark.parametrize("exc", ["NonFiniteError", "CheckpointError"])
def test_run_main_ends_these_errors_with_one_line(exc, capsys):
    from rlhf.train import checkpoint, optim
    from rlhf.cli import run_main

    cls = getattr(optim, exc, None) or getattr(checkpoint, exc)

    def fail():
        raise cls("actor: 4 consecutive non-finite optimizer steps")

    with pytest.raises(SystemExit) as e:
        run_main(fail)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: actor: 4 consecutive non-finite optimizer steps\n"


def test_steps_without_any_reward_stop_the_run_with_a_reason():
    """issue 33 item 6: a reward function that always hangs (or always raises) gives no learning signal;
    after reward.max_failed_steps such steps in a row the run stops with one line saying why."""
    from rlhf.rewards.scoring import FailedStepGuard, RewardFailureError

    guard = FailedStepGuard(max_steps=3, timeout_s=30)
    guard.update(n_errors=0, n_timeouts=16, n_samples=16)
    guard.update(n_errors=2, n_timeouts=14, n_samples=16)
    guard.update(n_errors=0, n_timeouts=15, n_samples=16)  # one sample scored: the count starts over
    guard.update(n_errors=16, n_timeouts=0, n_samples=16)
    guard.update(n_errors=0, n_timeouts=16, n_samples=16)
    with pytest.raises(RewardFailureError, match=r"no sample got a reward in 3 steps in a row \(last step: 16 of 16 "
                                                 r"calls timed out after reward.timeout_s=30 s"):
        guard.update(n_errors=0, n_timeouts=16, n_samples=16)
    never = FailedStepGuard(max_steps=0, timeout_s=30)
    for _ in range(10):
        never.update(0, 16, 16)
