"""The agent loop (TurnHandler) driven by hand, observation rendering, SFT demos, and the loop on the
real sampler + trainer: stitched log-probs equal the trainer's, observation tokens carry no gradient."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.agent.demos import tokenize_demo
from rlhf.agent.format import ObservationFormat, truncate
from rlhf.agent.loop import AgentLoop
from rlhf.agent.runner import SerialTools, ToolPool
from rlhf.data.arithmetic import tool_call
from rlhf.data.char_tokenizer import build_char_tokenizer
from tests.unit.test_tool_pool import moody_and_calculator

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    return moody_and_calculator(tmp_path_factory.mktemp("tools"))


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def _loop(specs, runner=None, **limits) -> AgentLoop:
    fmt = ObservationFormat(TOK, max_tool_response_length=64)
    return AgentLoop(TOK, runner or SerialTools(specs), fmt, {s[2]["function"]["name"]: s[2] for s in specs}, **limits)


# ----------------------------------------------------------------------------- rendering

def test_observation_follows_the_chat_template_once():
    fmt = ObservationFormat(TOK)
    assert fmt.text(["42"], ended_with_eos=True) == "<|user|><tool_response>42</tool_response><|assistant|>"
    # a turn that stopped on a stop sequence (e.g. "</tool_call>") still needs the end-of-turn token
    assert fmt.text(["42"], ended_with_eos=False).startswith("<eos><|user|>")
    assert fmt.ids(["42"], EOS) == enc("<|user|><tool_response>42</tool_response><|assistant|>")


def test_qwen_shaped_template_and_fallbacks():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
        "{{ '<|user|>\\n<tool_response>\\n' + m.content + '\\n</tool_response><eos>\\n' }}"
        "{%- else -%}{{ '<|' + m.role + '|>\\n' + m.content + '<eos>\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}")
    two = ObservationFormat(tok).text(["1", "2"], ended_with_eos=True)
    assert two == ("\n<|user|>\n<tool_response>\n1\n</tool_response><eos>\n"
                   "<|user|>\n<tool_response>\n2\n</tool_response><eos>\n<|assistant|>\n")
    tok.chat_template = None
    assert ObservationFormat(tok).text(["7"], True) == "\n<tool_response>\n7\n</tool_response>\n"
    tok.chat_template = "{%- for m in messages -%}{%- if m.role != 'tool' -%}{{ m.content }}{%- endif -%}{%- endfor -%}"
    with pytest.raises(ValueError, match="drops 'tool' messages"):
        ObservationFormat(tok)
    tok.chat_template = "{%- for m in messages -%}{{ raise_exception('no tools here') }}{%- endfor -%}"
    with pytest.raises(ValueError, match="cannot render a 'tool' message .*no tools here"):
        ObservationFormat(tok)


@pytest.mark.parametrize("side, want", [("left", "abcd...(truncated)"), ("right", "...(truncated)ghij"),
                                        ("middle", "ab...(truncated)ij")])
def test_truncate_sides(side, want):
    assert truncate("abcdefghij", 4, side) == want
    assert truncate("abc", 4, side) == "abc"


# ----------------------------------------------------------------------------- the loop by hand

def test_loop_parks_calls_renders_results_and_ends_plain_turns(specs):
    loop = _loop(specs)
    call = enc(tool_call("6*7")) + [EOS]
    assert loop.turn_ended(0, call) is True
    assert loop.turn_ended(1, enc("#### 5") + [EOS]) is False
    assert loop.turn_ended(2, enc('<tool_call>{"name": "calculator", "arguments": {"expression": ') + [EOS]) is True
    assert loop.turn_ended(3, enc(tool_call("7*")) + [EOS]) is True
    got = dict(loop.poll(wait=False))
    assert got[0] == enc("<|user|><tool_response>42</tool_response><|assistant|>")
    assert TOK.decode(got[2]).startswith("<|user|><tool_response>error: <tool_call> without")
    assert "error: invalid expression" in TOK.decode(got[3])
    assert loop.counts.calls == 3 and loop.counts.errors["parse"] == 1 and loop.counts.errors["tool_error"] == 1
    # the next turn is parsed on its own: the earlier call is not seen again
    assert loop.turn_ended(0, call + got[0] + enc("#### 42") + [EOS]) is False
    assert loop.rows[0].turns == 2 and loop.rows[0].observations == 1


def test_loop_limits(specs):
    two_calls = enc(tool_call("1+1") + tool_call("2+2")) + [EOS]
    loop = _loop(specs, max_parallel_calls=1)
    assert loop.turn_ended(0, two_calls)
    (row, ids), = loop.poll(wait=True)
    assert TOK.decode(ids).count("<tool_response>") == 1 and loop.counts.calls == 1
    loop = _loop(specs, max_parallel_calls=2)
    loop.turn_ended(0, two_calls)
    assert TOK.decode(loop.poll(wait=True)[0][1]) == \
        "<|user|><tool_response>2</tool_response><|user|><tool_response>4</tool_response><|assistant|>"
    for limits in ({"max_assistant_turns": 2}, {"max_user_turns": 1}):
        loop = _loop(specs, **limits)
        first = enc(tool_call("1+1")) + [EOS]
        assert loop.turn_ended(0, first)
        obs = loop.poll(wait=True)[0][1]
        assert loop.turn_ended(0, first + obs + first) is False, limits  # the limit ends the trajectory
    loop = _loop(specs, max_assistant_turns=1)
    assert loop.turn_ended(0, enc(tool_call("1+1")) + [EOS]) is False


def test_loop_polls_the_pool_without_blocking(specs, tmp_path):
    gate = tmp_path / "gate"
    with ToolPool(specs, num_workers=1, timeout_s=30) as pool:
        loop = _loop(specs, runner=pool)
        call = '<tool_call>{"name": "moody", "arguments": {"mode": "gate:%s"}}</tool_call>' % gate
        assert loop.turn_ended(5, enc(call) + [EOS])
        assert loop.poll(wait=False) == []  # the tool is still running
        gate.touch()
        (row, ids), = loop.poll(wait=True)
        assert row == 5 and "<tool_response>OPEN</tool_response>" in TOK.decode(ids)


# ----------------------------------------------------------------------------- SFT demos = rollouts

def test_sft_demo_tokens_are_what_the_loop_builds(specs):
    demo = [{"role": "assistant", "content": tool_call("6*7")}, {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "#### 42"}]
    ids, mask = tokenize_demo(TOK, demo, ObservationFormat(TOK, max_tool_response_length=0))
    loop = _loop(specs)
    first = enc(tool_call("6*7")) + [EOS]
    loop.turn_ended(0, first)
    obs = loop.poll(wait=True)[0][1]
    assert ids == first + obs + enc("#### 42") + [EOS]
    assert mask == [1] * len(first) + [0] * len(obs) + [1] * (len(enc("#### 42")) + 1)
    for bad in ([], [{"role": "tool", "content": "1"}], [demo[0], demo[2]], [{"role": "user", "content": "x"}]):
        with pytest.raises(ValueError):
            tokenize_demo(TOK, bad, ObservationFormat(TOK))


def test_sft_rows_mask_tool_results_out_of_the_loss(tmp_path):
    from rlhf.train.sft import SFTSettings, collate, tokenize_sft

    demo = [{"role": "assistant", "content": tool_call("6*7")}, {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "#### 42"}]
    rows = [{"prompt": "6*7=", "response": demo}, {"prompt": "1+1=", "response": "#### 2"},
            {"prompt": "x", "response": [{"role": "tool", "content": "1"}]}]
    examples, stats = tokenize_sft(rows, TOK, SFTSettings(max_length=256))
    assert stats["n_loaded"] == 2 and stats["n_malformed"] == 1
    ids, attn, loss_mask = collate(examples, TOK.pad_token_id)  # [B, P + R], loss mask [B, R]
    P = ids.shape[1] - loss_mask.shape[1]
    obs = enc("<|user|><tool_response>42</tool_response><|assistant|>")
    start = len(enc(tool_call("6*7"))) + 1  # in response coordinates
    assert ids[0, P + start:P + start + len(obs)].tolist() == obs
    assert loss_mask[0, start:start + len(obs)].sum() == 0
    assert loss_mask[0, :start].all() and loss_mask[0, start + len(obs):int(attn[0].sum()) - len(examples[0][0])].all()
    assert loss_mask[1].sum() == len(enc("#### 2")) + 1


# ----------------------------------------------------------------------------- on the sampler and trainer

class ScriptedTokenizer:
    """The char tokenizer, except that an assistant turn ending in a digit decodes to a calculator call
    (a random model never writes one): ``<digit>*<turn length>``."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        last = self.tok.decode(ids[-1:])
        if last.isdigit():
            return tool_call(f"{last}*{len(ids)}")
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    write_tiny_model(str(d), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return str(d)


def _worker(model_dir, mesh, **actor):
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, grad_clip=1e9,
                      weight_decay=0.0, **actor)
    return PolicyWorker(ModelConfig(path=model_dir, mixed_precision=False), mesh, torch.device("cpu"),
                        actor_cfg=cfg, total_steps=1)


@pytest.fixture(scope="module")
def holed_batch(tiny_model, mesh, specs):
    """A multi-turn batch from the sampler with the agent loop (turns end on digits 3 and 7)."""
    from rlhf.rollout.engine import RolloutEngine
    from rlhf.schema.batch import PromptBatch
    from rlhf.schema.config import RolloutConfig

    worker = _worker(tiny_model, mesh)
    engine = RolloutEngine(RolloutConfig(n=2, stop=["3", "7"], seed=1), TOK, max_prompt_length=8,
                           max_response_length=48, device=torch.device("cpu"))
    prompts = PromptBatch(prompt_ids=[enc(f"{a}+{b}=") for a, b in ((12, 34), (56, 7), (8, 90), (11, 22))],
                          keys=[0, 1, 2, 3], ground_truths=[""] * 4, data_sources=["t"] * 4, extra_infos=[{}] * 4)
    loop = AgentLoop(ScriptedTokenizer(TOK), SerialTools(specs), ObservationFormat(TOK, max_tool_response_length=64),
                     {s[2]["function"]["name"]: s[2] for s in specs}, max_assistant_turns=3)
    batch, _ = engine.generate(worker.model, worker.hf_config, prompts, step=1, n=2, temperature=1.0, turns=loop)
    return worker, batch, loop


def test_stitched_log_probs_equal_the_trainers_recomputation(holed_batch):
    worker, batch, loop = holed_batch
    P = batch.input_ids.shape[1] - batch.responses.shape[1]
    holes = batch.attention_mask[:, P:].float() - batch.response_mask
    assert loop.counts.calls >= 4 and holes.sum() > 0 and (holes >= 0).all()
    # the holes hold the rendered calculator results
    text = TOK.decode(batch.responses[holes.bool()].tolist())
    assert "<tool_response>" in text and "error" not in text
    lp, _ = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=4)
    m = batch.response_mask
    torch.testing.assert_close(lp * m, batch.rollout_log_probs * m, atol=1e-4, rtol=0)
    assert (batch.rollout_log_probs[holes.bool()] == 0).all()


def test_observation_tokens_carry_no_gradient(holed_batch, tiny_model, mesh):
    """Advantages, old / reference / sampler log-probs at observation positions do not move the update."""
    _, batch, _ = holed_batch
    P = batch.input_ids.shape[1] - batch.responses.shape[1]
    holes = (batch.attention_mask[:, P:].float() - batch.response_mask).bool()
    g = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.old_log_probs = batch.rollout_log_probs.clone()
    batch.ref_log_probs = batch.rollout_log_probs - 0.1 * batch.response_mask

    def update(b):
        w = _worker(tiny_model, mesh, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
        metrics = w.update_policy(b, mini_batch_rows=len(b), temperature=1.0, max_response_length=48)
        return metrics, {n: p.full_tensor().detach().clone() for n, p in w.model.named_parameters()}

    m1, p1 = update(batch)
    bad = batch.select(list(range(len(batch))))
    for name in ("advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs"):
        t = getattr(bad, name).clone()
        t[holes] = torch.randn(int(holes.sum()), generator=g) * 50
        setattr(bad, name, t)
    m2, p2 = update(bad)
    assert m1["actor/loss"] == m2["actor/loss"] and m1["actor/grad_norm"] == m2["actor/grad_norm"] > 0
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name


def test_metrics_are_hand_counted(tmp_path):
    """Two rows: [gen gen obs obs gen pad] and [gen pad ...]; 3 calls, one parse error."""
    from types import SimpleNamespace

    from rlhf.agent.loop import AgentCounts
    from rlhf.agent.rollout import ToolAgent
    from rlhf.schema.config import MultiTurnConfig

    (tmp_path / "t.yaml").write_text("tools:\n  - class_name: calculator\n")
    agent = ToolAgent(MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "t.yaml"), num_workers=0), TOK)
    resp = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])  # 2 prompt columns
    counts = AgentCounts(calls=3)
    counts.errors["parse"] = 1
    class Batch(SimpleNamespace):
        def __len__(self):
            return 2

    m = agent.metrics(Batch(response_mask=resp, attention_mask=attn), SimpleNamespace(counts=counts))
    assert m["agent/tool_calls_per_traj"] == 1.5 and m["agent/turns_per_traj"] == 1.5
    assert m["agent/observation_tokens_per_traj"] == 1.0 and m["agent/tool_error_rate"] == pytest.approx(1 / 3)
    assert m["agent/tool_errors/parse"] == 1 and m["agent/tool_errors/timeout"] == 0
    agent.close()


def test_train_sft_on_multi_turn_demos(tiny_model, mesh, tmp_path):
    """run_sft (train_sft.py's body) trains on multi-turn rows and exports the model."""
    from rlhf.schema.config import ModelConfig
    from rlhf.train.sft import SFTConfig, SFTRunConfig, SFTSettings, run_sft

    demo = [{"role": "assistant", "content": tool_call("6*7")}, {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "#### 42"}]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps({"prompt": "6*7=", "response": demo}) for _ in range(8)))
    cfg = SFTConfig(model=ModelConfig(path=tiny_model, mixed_precision=False),
                    sft=SFTSettings(train_files=str(tmp_path / "sft.jsonl"), train_batch_size=4,
                                    micro_batch_size_per_gpu=4, max_length=160),
                    trainer=SFTRunConfig(output_dir=str(tmp_path / "out"), device="cpu", logger=[]))
    last = run_sft(cfg)
    assert 0 < last["sft/loss"] < 10 and (tmp_path / "out" / "hf_export" / "config.json").is_file()
