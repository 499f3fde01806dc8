"""Reward-model scoring: an HF sequence-classification checkpoint reads prompt + response.

The RM is frozen, FSDP2-sharded on the training mesh (colocated with the actor) and run
in micro-batches. Its score is taken at the last real token of each sequence, located
from the attention mask (HF's own pooling looks for the rightmost id != pad_token_id,
which is wrong when pad == eos and the response ends in eos).

Tokenizers. Actor ids are fed to the RM only when the two tokenizers are the same
(same class, vocabulary and chat template, and no separate ``tokenizer_path``).
Otherwise every row is re-tokenised from text, never by mixing ids:

1. the user prompt is recovered from ``batch.input_ids`` with the actor tokenizer: the
   rendered prompt is decoded and the actor's chat-template wrapper around a single user
   turn is stripped (if the prompt does not have that shape, e.g. it has a system turn,
   the decoded text without special tokens is used);
2. the RM text is the RM's chat template applied to ``[user: prompt, assistant: response]``
   when the RM tokenizer has one, else ``prompt + response``;
3. it is tokenised with the RM tokenizer.

Sequences longer than ``max_length`` keep their last ``max_length`` tokens (the prompt is
cut from the left, the response and the scoring position survive).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlhf.models.fsdp import apply_fsdp
from rlhf.models.loading import DTYPES, check_model_dir, load_tokenizer
from rlhf.models.logprobs import position_ids_from_mask
from rlhf.models.value_head import value_head
from rlhf.schema.batch import RolloutBatch, split_rows
from rlhf.schema.config import ConfigError, RewardModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SENTINEL = "\u2063RLHF_PROMPT\u2063"


class LastTokenScore(torch.nn.Module):
    """Wrap a ``*ForSequenceClassification`` model: ``[B, L]`` ids/mask -> score ``[B]`` at the last real token."""

    def __init__(self, seq_cls: torch.nn.Module):
        super().__init__()
        self.model = seq_cls  # attribute name `model` so rlhf.models.loading.decoder_layers finds the blocks

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids_from_mask(attention_mask),
                                       use_cache=False).last_hidden_state  # [B, L, H]
        L = attention_mask.shape[1]
        last = (L - 1) - attention_mask.flip(-1).long().argmax(-1)  # [B] last position with mask 1
        h_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
        return value_head(self.model)(h_last)[:, 0].float()


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when ids of one mean the same text to the other (and prompts render the same)."""
    if a is b:
        return True
    return (type(a) is type(b) and a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template
            and a.bos_token_id == b.bos_token_id and a.eos_token_id == b.eos_token_id)


def chat_wrapper(tokenizer: PreTrainedTokenizerBase) -> Optional[tuple[str, str]]:
    """(prefix, suffix) that the chat template puts around one user turn (+ generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        return None
    prefix, suffix = text.split(_SENTINEL)
    return prefix, suffix


class RewardModelScorer:
    """Score RolloutBatch rows with a frozen sequence-classification reward model."""

    def __init__(self, cfg: RewardModelConfig, mesh: DeviceMesh, device: torch.device,
                 actor_tokenizer: PreTrainedTokenizerBase, *, dtype: str = "float32", mixed_precision: bool = True,
                 attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                 build_model: Optional[Callable[[], torch.nn.Module]] = None):
        if cfg.micro_batch_size_per_gpu <= 0 or cfg.max_length <= 0:
            raise ConfigError("config keys 'reward.reward_model.micro_batch_size_per_gpu' and "
                              "'reward.reward_model.max_length' must be > 0")
        self.cfg = cfg
        self.device = device
        self.actor_tokenizer = actor_tokenizer
        path = check_model_dir(cfg.path, "reward.reward_model.path")
        self.tokenizer, self.retokenize = self._resolve_tokenizer(path, trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._actor_wrapper = chat_wrapper(actor_tokenizer)
        if build_model is not None:
            model = build_model()
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code)
        if model.config.num_labels != 1:
            raise ConfigError(f"reward.reward_model.path: {cfg.path} has num_labels={model.config.num_labels}; "
                              "a reward model needs a single scalar output (num_labels=1)")
        value_head(model)  # fail now, not at the first step, if there is no scalar head
        model.requires_grad_(False)
        model.eval()
        self.model = apply_fsdp(LastTokenScore(model), mesh["dp"], device=device, mixed_precision=mixed_precision)

    def _resolve_tokenizer(self, path: Path, trust_remote_code: bool) -> tuple[PreTrainedTokenizerBase, bool]:
        if self.cfg.tokenizer_path:
            key = "reward.reward_model.tokenizer_path"
            return load_tokenizer(self.cfg.tokenizer_path, trust_remote_code, key), True
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            return self.actor_tokenizer, False  # no tokenizer of its own: it was trained on the actor's
        tok = load_tokenizer(str(path), trust_remote_code, "reward.reward_model.path")
        return tok, not same_tokenizer(tok, self.actor_tokenizer)

    # ------------------------------------------------------------------ inputs

    def user_prompts(self, batch: RolloutBatch) -> list[str]:
        """The user prompt of each row, recovered from the actor-tokenised, rendered prompt."""
        P = batch.input_ids.shape[1] - batch.response_length
        prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids[:, :P].cpu(),
                                                                 batch.attention_mask[:, :P].cpu())]
        rendered = self.actor_tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        plain = self.actor_tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        out = []
        for full, fallback in zip(rendered, plain):
            w = self._actor_wrapper
            if w is not None and full.startswith(w[0]) and full.endswith(w[1]) and len(full) >= len(w[0]) + len(w[1]):
                out.append(full[len(w[0]):len(full) - len(w[1])])
            else:
                out.append(fallback)
        return out

    def texts(self, batch: RolloutBatch) -> list[str]:
        """What the RM reads for each row (only used when re-tokenising)."""
        prompts = self.user_prompts(batch)
        responses = batch.response_texts
        if len(responses) != len(batch):
            responses = self.actor_tokenizer.batch_decode(
                [r[m.bool()].tolist() for r, m in zip(batch.responses.cpu(), batch.response_mask.cpu())],
                skip_special_tokens=True)
        if getattr(self.tokenizer, "chat_template", None):
            return [self.tokenizer.apply_chat_template([{"role": "user", "content": p},
                                                        {"role": "assistant", "content": r}], tokenize=False)
                    for p, r in zip(prompts, responses)]
        return [p + r for p, r in zip(prompts, responses)]

    def token_ids(self, batch: RolloutBatch) -> list[list[int]]:
        """RM token ids per row (re-tokenising path), left-truncated to max_length."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        enc = self.tokenizer(self.texts(batch), add_special_tokens=not has_template)["input_ids"]
        return [ids[-self.cfg.max_length:] for ids in enc]

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, L - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _truncate_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Drop (mask out) the first real tokens of rows longer than max_length. [B, L] -> [B, L]."""
        seen_from_end = attention_mask.flip(-1).cumsum(-1).flip(-1)  # real tokens at or after each position
        return attention_mask * (seen_from_end <= self.cfg.max_length).to(attention_mask.dtype)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """Scores [N] (fp32) of prompt + response, one per row."""
        mb = self.cfg.micro_batch_size_per_gpu
        out = []
        if self.retokenize:
            rows = self.token_ids(batch)
            for idx in split_rows(len(rows), mb):
                ids, mask = self._left_pad([rows[i] for i in idx.tolist()])
                out.append(self.model(ids, mask))
        else:
            for idx in split_rows(len(batch), mb):
                mask = self._truncate_mask(batch.attention_mask[idx])
                out.append(self.model(batch.input_ids[idx], mask))
        return torch.cat(out) if out else torch.zeros(0, device=self.device)
