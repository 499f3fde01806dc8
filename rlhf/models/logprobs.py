"""Per-token log-probs (and entropy) of response tokens: the padded reference path.

A rollout row is ``[left-padded prompt (P) | right-padded response (R)]``. Log-probs are
of ``softmax(logits / temperature)``, the distribution the sampler reports (see
rlhf/rollout/sampling.py), so trainer and sampler agree on "old" log-probs.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.kl import entropy_from_logits


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L] positions counting only real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    compute_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(logits/T)[label] without materialising a second [.., V] log-softmax tensor.

    logits [B, R, V], labels [B, R] -> log_probs [B, R] (fp32), entropy [B, R] or None.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(logits) if compute_entropy else None
    return picked - lse, entropy


def forward_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                      response_length: int, temperature: float = 1.0,
                      compute_entropy: bool = False,
                      multi_modal: Optional[dict] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Teacher-forced log-probs of the last `response_length` tokens.

    input_ids, attention_mask: [B, L]; returns log_probs [B, R] where entry t scores
    input_ids[:, L-R+t] from the logits at position L-R+t-1 (padding positions are
    arbitrary and masked by the caller). `multi_modal` (a vision-language model's batch images,
    ``rlhf.data.multimodal.collate_multi_modal``) adds the images and M-RoPE positions.
    """
    R = response_length
    if multi_modal is not None:
        from rlhf.models.vlm import padded_inputs

        extra = padded_inputs(model, input_ids, attention_mask, multi_modal)
    else:
        extra = {"position_ids": position_ids_from_mask(attention_mask)}
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=R + 1, **extra)
    logits = out.logits[:, :-1, :]  # [B, R, V]
    return token_log_probs(logits, input_ids[:, -R:], temperature, compute_entropy)
