"""Multi-turn tool-use demonstrations -> the token ids a rollout of the same conversation produces.

A demonstration's response is a list of messages after the prompt::

    [{"role": "assistant", "content": "<tool_call>{...}</tool_call>"},
     {"role": "tool", "content": "7006652"},
     {"role": "assistant", "content": "#### 7006652"}]

Each assistant turn is its content's tokens plus EOS (the stop token a sampled turn ends
with); each run of tool messages is the tool-response turn rendered exactly as the agent loop
renders it (:class:`rlhf.agent.format.ObservationFormat`). So supervised warm-starts train on
the same token sequences the RL rollouts produce, and the loss mask is 1 on assistant tokens
and 0 on the observation tokens, as ``response_mask`` is in RL.
"""

from __future__ import annotations

from typing import Any

from rlhf.agent.format import ObservationFormat


def tokenize_demo(tokenizer: Any, messages: list, fmt: ObservationFormat) -> tuple[list[int], list[int]]:
    """``(response ids, loss mask)`` of a multi-turn response; ValueError naming what is malformed."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise ValueError("a multi-turn response must be a non-empty list of {'role', 'content'} messages")
    roles = [m.get("role") for m in messages]
    bad = sorted({r for r in roles if r not in ("assistant", "tool")}, key=str)
    if bad:
        raise ValueError(f"a multi-turn response has roles {bad}; expected assistant and tool")
    if roles[0] != "assistant" or roles[-1] != "assistant":
        raise ValueError("a multi-turn response must start and end with an assistant message")
    if any(a == b == "assistant" for a, b in zip(roles, roles[1:])):
        raise ValueError("a multi-turn response has two assistant messages in a row (a turn without a tool call "
                         "ends the trajectory)")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    k = 0
    while k < len(messages):
        if roles[k] == "assistant":
            turn = tokenizer.encode(messages[k]["content"], add_special_tokens=False) + [eos]
            ids += turn
            mask += [1] * len(turn)
            k += 1
            continue
        results = []
        while k < len(messages) and roles[k] == "tool":
            results.append(messages[k]["content"])
            k += 1
        obs = fmt.ids(results, last_token=ids[-1])
        ids += obs
        mask += [0] * len(obs)
    return ids, mask
