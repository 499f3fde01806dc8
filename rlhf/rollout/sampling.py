"""Token sampling for the rollout: sampling parameters, counter-based seeding, processing.

Everything here is tensor ops on the device, batched over the sequences of a decode step;
there is no Python work per sequence.

Seeding. Each sampled token consumes exactly one uniform number ``u`` in (0, 1) derived
from a counter-based hash of ``(seed, step, prompt_key, sample_index, position)``
(``position`` = index of the token in the response). Nothing depends on the rank, the
batch composition, the slot a sequence lives in or the order of admission, so the same
prompt key draws the same responses on any parallel layout. A token is drawn by inverse-CDF
sampling: the first token (in candidate order) whose cumulative processed probability
exceeds ``u * total``.

Log-probabilities. The returned log-prob of a sampled token ``y_t`` is

    log pi(y_t | ...) = log_softmax(logits / T)[y_t]          (T = 1 for greedy)

i.e. the temperature-scaled distribution over the FULL vocabulary, BEFORE top-k / top-p /
min-p truncation. This is exactly what the trainer recomputes in a teacher-forced forward
(verl also divides the logits by the rollout temperature when it recomputes old
log-probs), so the two agree to fp32 round-off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
# Multiplier of the "0x45d9f3b" integer hash; it is < 2**27 so the product of a 32-bit
# value with it stays below 2**59 and never overflows int64.
_MIX_MUL = 0x45D9F3B
_TWO_POW_24 = float(1 << 24)


@dataclass
class SamplingParams:
    """Sampling settings of one ``Sampler.generate`` call (names follow verl / vLLM).

    ``temperature == 0`` means greedy (argmax). ``top_k = -1`` (or 0) disables top-k.
    ``stop_token_ids``: EOS ids and other single-token stops; the stop token is part of the
    response. ``stop_sequences``: stop strings pre-tokenised by the caller; generation of a
    sequence stops once its response ends with one of them, and the matched tokens stay in
    the response. ``seed`` keys the counter-based sampler together with the training step,
    the prompt key and the sample index.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    stop_sequences: Sequence[Sequence[int]] = field(default_factory=tuple)
    seed: int = 0

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for t in self.stop_token_ids:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        for s in self.stop_sequences:
            if len(s) == 0:
                raise ValueError("SamplingParams.stop_sequences contains an empty sequence")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# --------------------------------------------------------------------------- hashing


def mix32(x: Tensor) -> Tensor:
    """Integer avalanche hash of 32-bit values held in int64 tensors (any shape).

    Every multiply is followed by an explicit ``& 0xFFFFFFFF`` and the operands are
    < 2**32 and < 2**27, so nothing relies on integer overflow.
    """
    x = ((x >> 16) ^ x) * _MIX_MUL & _M32
    x = ((x >> 16) ^ x) * _MIX_MUL & _M32
    x = ((x >> 16) ^ x) * _MIX_MUL & _M32
    return (x >> 16) ^ x


def _absorb(h: Tensor, value: Tensor) -> Tensor:
    """Fold a 64-bit integer tensor into the running 32-bit hash ``h``."""
    h = mix32(h ^ (value & _M32))
    return mix32(h ^ ((value >> 32) & _M32))


def sequence_keys(seed: int, step: int, prompt_keys: Tensor, sample_index: Tensor) -> Tensor:
    """Per-sequence hash state from ``(seed, step, prompt_key, sample_index)``.

    Args:
        prompt_keys: ``[N]`` int64, global dataset index of each sequence's prompt.
        sample_index: ``[N]`` int64, index ``j`` of the sample among the ``n`` of its prompt.
    Returns:
        ``[N]`` int64 in ``[0, 2**32)``.
    """
    dev = prompt_keys.device
    h = torch.full_like(prompt_keys, 0x9E3779B9)
    h = _absorb(h, torch.tensor(int(seed), dtype=torch.int64, device=dev))
    h = _absorb(h, torch.tensor(int(step), dtype=torch.int64, device=dev))
    h = _absorb(h, prompt_keys.long())
    return _absorb(h, sample_index.long())


def position_keys(max_new_tokens: int, device: torch.device) -> Tensor:
    """``[max_new_tokens]`` int64 hash of each response position (a lookup table)."""
    pos = torch.arange(max_new_tokens, dtype=torch.int64, device=device)
    return mix32(mix32(pos ^ 0x7F4A7C15) ^ 0x2545F491)


def uniforms(seq_keys: Tensor, pos_keys: Tensor) -> Tensor:
    """Uniforms in (0, 1] for keys x positions (broadcasting int64 inputs), float32.

    24 random bits: ``(h24 + 1) / 2**24`` is exact in float32 and never 0.
    """
    h = mix32(seq_keys ^ pos_keys)
    return ((h >> 8) + 1).float() * (1.0 / _TWO_POW_24)


# --------------------------------------------------------------------------- sampling


_cumsum = torch.cumsum  # the seam a CPU test replaces with a GPU-like (non-monotone) scan


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """``[B, 1]``: the first index whose running sum reaches ``u * total``; where that index has
    probability 0, the next index with positive probability (the last one before it if none follows).

    A sequential cumsum (CPU) is monotone and adds exactly 0 for a zero-probability entry, so the
    first index reaching the threshold has positive probability and the guard changes nothing, so it is
    skipped there (a NaN row, whose log-prob is NaN either way, then picks the last index instead of 0).
    A GPU cumsum is a parallel scan whose prefixes round differently: the running sum can step up
    at a zero-probability entry (a token top-p / min-p removed), which searchsorted would pick
    (log-prob -inf)."""
    v = probs.shape[-1]
    cdf = _cumsum(probs, dim=-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp_(max=v - 1)
    if _cumsum is torch.cumsum and probs.device.type == "cpu":
        return choice  # the guard is a no-op here (above) and ~4/5 of this function's CPU time at decode sizes
    idx = torch.arange(v, device=probs.device).expand_as(probs)
    positive = probs > 0
    following = torch.where(positive, idx, v).flip(-1).cummin(dim=-1).values.flip(-1).gather(1, choice)
    preceding = torch.where(positive, idx, 0).cummax(dim=-1).values.gather(1, choice)
    return torch.where(following < v, following, preceding)


# Candidates the top-p nucleus is first looked for among (the largest logits); rows whose nucleus
# reaches past them fall back to sorting the whole vocabulary (bench/top_p.py: the share that does).
TOP_P_PREFILTER = 1024


def _stable_descending(values: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Reorder candidate ``values`` [B, k] (with vocabulary ``index``) into the order a stable
    descending sort of the whole vocabulary gives them: by value, ties by ascending index."""
    index, perm = index.sort(dim=-1)
    values, perm2 = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return values, index.gather(1, perm2)


def top_p_nucleus(logp: Tensor, top_p: float, prefilter: int = TOP_P_PREFILTER) -> tuple[Tensor, Tensor]:
    """The top-p (nucleus) distribution of ``logp`` [B, V] (log-probs over the vocabulary).

    HF's ``TopPLogitsWarper`` rule: in stable descending order, keep a token when the mass strictly
    before it is < ``top_p`` (so the most likely token always stays). Returns ``probs`` [B, k] (the
    full-vocabulary probabilities of the kept tokens, 0 after them, in that order) and their
    vocabulary ``index`` [B, k]; sampling renormalises over the kept mass.

    Without sorting the vocabulary: the ``prefilter`` largest log-probs (``topk``) are put in the
    stable order; the nucleus lies among them exactly when the mass of the candidates strictly
    above the smallest candidate value (a tie group there may be cut by ``topk``) already reaches
    ``top_p``; then every kept token, its order and its cumulative mass are those of the full
    sort. Otherwise (a flat distribution) the whole vocabulary is sorted. The check costs one
    host sync per call. The probabilities are ``exp(logp - max) / sum`` with the sum over the
    vocabulary in its natural order on both paths, so which path ran changes nothing.
    """
    v = logp.shape[-1]
    top = logp.amax(dim=-1, keepdim=True)
    total = (logp - top).exp_().sum(dim=-1, keepdim=True)
    if prefilter < v:
        cand, index = _stable_descending(*logp.topk(prefilter, dim=-1, sorted=False))
        probs = (cand - top).exp_().div_(total)
        before = probs.cumsum(dim=-1) - probs
        boundary = (cand == cand[:, -1:]).int().argmax(dim=-1, keepdim=True)  # first of the last tie group
        if bool((before.gather(1, boundary) >= top_p).all()):
            return probs.masked_fill_(before >= top_p, 0.0), index
    cand, index = logp.sort(dim=-1, descending=True, stable=True)
    probs = (cand - top).exp_().div_(total)
    before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill_(before >= top_p, 0.0), index


def sample_next(logits: Tensor, params: SamplingParams, u: Tensor | None) -> tuple[Tensor, Tensor]:
    """Pick one token per row and return its log-prob under the temperature-scaled distribution.

    Processing order follows HF / vLLM: temperature, then top-k, top-p (computed on the
    distribution renormalised after top-k), min-p (relative to the max probability).
    The token is drawn by inverse CDF: the first candidate ``i`` with ``cdf[i] >= u * cdf[-1]``
    (``cdf`` = running sum of the processed probabilities in candidate order). With
    ``u`` in (0, 1] the threshold lies in (0, total], so the pick is always a candidate
    with positive probability, also with float32 round-off.

    Args:
        logits: ``[B, V]`` float32 next-token logits.
        params: sampling settings (shared by the whole batch).
        u: ``[B]`` float32 uniforms in (0, 1]; ignored (may be None) for greedy.
    Returns:
        tokens ``[B]`` int64 and log_probs ``[B]`` float32 = ``log_softmax(logits / T)[token]``
        with ``T = 1`` for greedy.
    """
    if params.greedy:
        tok = logits.argmax(dim=-1, keepdim=True)  # first max, like HF
        return tok.squeeze(1), torch.log_softmax(logits, dim=-1).gather(1, tok).squeeze(1)
    assert u is not None
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    vocab = scaled.shape[-1]
    use_top_k = 0 < params.top_k < vocab
    if not (use_top_k or params.top_p < 1.0 or params.min_p > 0.0):
        # plain temperature sampling: natural vocabulary order, no sort, one softmax
        probs = torch.softmax(scaled, dim=-1)
        # NaN logits (a model with NaN weights) find no threshold: inverse_cdf keeps the index in range and
        # their NaN log-prob is what RolloutEngine.to_batch reports, without a host sync here.
        tok = inverse_cdf(probs, u)  # [B, 1]
        return tok.squeeze(1), probs.gather(1, tok).log_().squeeze(1)
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V] untruncated, for the returned log-probs
    cand_idx: Tensor | None = None
    if use_top_k:
        cand, cand_idx = logp.topk(params.top_k, dim=-1, sorted=True)  # [B, k] descending
        probs = torch.softmax(cand, dim=-1)  # renormalised over the top-k
    elif params.top_p < 1.0:
        probs, cand_idx = top_p_nucleus(logp, params.top_p)  # [B, k <= V] descending, 0 past the nucleus
    else:
        probs = torch.softmax(logp, dim=-1)
    if params.top_p < 1.0 and use_top_k:
        # keep a token when the mass strictly before it (in descending order) is < top_p;
        # this is HF's TopPLogitsWarper rule and always keeps the most likely token.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    if params.min_p > 0.0:
        pmax = probs[:, :1] if cand_idx is not None else probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < params.min_p * pmax, 0.0)
    choice = inverse_cdf(probs, u)  # [B, 1]
    tok = cand_idx.gather(1, choice) if cand_idx is not None else choice
    return tok.squeeze(1), logp.gather(1, tok).squeeze(1)
