"""Tool results -> the token ids appended to a trajectory (the tool-response turn).

Token-in / token-out: the trajectory's tokens so far are never re-rendered. Only the new
piece is rendered, with the tokenizer's own chat template: the text the template writes
after an assistant message's content, through the tool messages, up to and including the
next assistant generation prompt. For Qwen2.5 that is::

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

When the turn already ended with the template's end-of-turn token (the EOS the sampler
stopped on), that leading piece is dropped, so it is not there twice. The piece is found by
rendering a probe conversation with marker strings, so any template that renders ``tool``
messages works; a template without a tool role is refused at start-up with one line. A
tokenizer with no chat template gets ``\\n<tool_response>\\n...\\n</tool_response>\\n``.
"""

from __future__ import annotations

from typing import Any, Literal

_ASSISTANT = "RLHF_AGENT_ASSISTANT_MARK"
_TOOL = "RLHF_AGENT_TOOL_MARK"
TRUNCATED = "...(truncated)"


def truncate(text: str, max_chars: int, side: Literal["left", "middle", "right"] = "middle") -> str:
    """At most ``max_chars`` characters of ``text`` kept (verl's tool_response_truncate_side: ``left``
    keeps the start, ``right`` the end, ``middle`` both ends), with a marker where text was cut."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + TRUNCATED
    if side == "right":
        return TRUNCATED + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + TRUNCATED + text[len(text) - (max_chars - half):]


class ObservationFormat:
    """Renders tool results as the tokens of a tool-response turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, max_tool_response_length: int = 256,
                 truncate_side: Literal["left", "middle", "right"] = "middle") -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_tool_response_length
        self.side = truncate_side
        self.templated = getattr(tokenizer, "chat_template", None) is not None
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.templated:
            self._check_template()

    def _render_tail(self, texts: list[str]) -> str:
        msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]
        msgs += [{"role": "tool", "content": t} for t in texts]
        full = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return full[full.index(_ASSISTANT) + len(_ASSISTANT):]

    def _check_template(self) -> None:
        try:
            tail = self._render_tail([_TOOL])
        except Exception as e:  # jinja raises its own error types for an unknown role
            raise ValueError(f"rollout.multi_turn: the tokenizer's chat template cannot render a 'tool' message "
                             f"({type(e).__name__}: {e}); use a model whose template has a tool role") from None
        if _TOOL not in tail:
            raise ValueError("rollout.multi_turn: the tokenizer's chat template drops 'tool' messages; "
                             "use a model whose template renders a tool role")

    def text(self, results: list[str], ended_with_eos: bool) -> str:
        """The tool-response turn for ``results`` (one per call), as text."""
        results = [truncate(r, self.max_chars, self.side) for r in results]
        if not self.templated:
            return "".join(f"\n<tool_response>\n{r}\n</tool_response>\n" for r in results)
        tail = self._render_tail(results)
        if ended_with_eos:
            # The turn's stop token already closed the assistant message: skip the template's copy.
            for eos in self.eos_ids:
                mark = self.tokenizer.convert_ids_to_tokens(eos)
                if mark and tail.startswith(mark):
                    return tail[len(mark):]
        return tail

    def ids(self, results: list[str], last_token: int) -> list[int]:
        """Token ids of the tool-response turn after a turn that ended with ``last_token``."""
        text = self.text(results, ended_with_eos=last_token in self.eos_ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
