"""Per-token log-probabilities and entropy from vocab-sharded logits.

Under tensor parallelism the LM head is column-parallel: rank ``r`` of the tp group holds
logits for the vocab slice ``[vocab_start, vocab_start + V/tp)``. The RL losses need only

    log p(y_t) = z_{y_t} - log sum_v exp(z_v)                       (log-softmax of the label)
    H_t        = log sum_v exp(z_v) - sum_v p_v z_v                  (entropy of the softmax)

with ``z = logits / temperature``. Both are sums over the vocab, so each rank reduces its
slice and three scalars per token are all-reduced (max, sum-exp, picked logit; plus
``sum p z`` for the entropy) instead of all-gathering ``[N, V]`` logits
(Megatron's "vocab-parallel cross entropy").

The backward needs no communication: the gradient of the replicated outputs is the same
on every tp rank, and

    d log p(y) / d z_j = 1[j = y] - p_j
    d H / d z_j        = -p_j (z_j - sum_v p_v z_v)

are computed locally for the rank's vocab slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


class _VocabParallelLogProbs(torch.autograd.Function):
    """Autograd function; see :func:`vocab_parallel_log_probs` for the contract."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,  # [N, Vl] float32, already divided by the temperature
        labels: torch.Tensor,  # [N]
        group: dist.ProcessGroup | None,
        vocab_start: int,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab_local = logits.shape[-1]
        # Global max for a stable exp; it cancels in every output, so no gradient flows.
        logits_max = logits.max(dim=-1).values  # [N]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # [N, Vl]
        exp = shifted.exp()  # [N, Vl]

        in_slice = (labels >= vocab_start) & (labels < vocab_start + vocab_local)  # [N]
        local_idx = (labels - vocab_start).clamp(0, vocab_local - 1)  # [N]
        picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)  # [N]
        picked = torch.where(in_slice, picked, torch.zeros_like(picked))

        # One all-reduce for the sums: [sum exp, picked (, sum exp * z)].
        parts = [exp.sum(-1), picked]
        if compute_entropy:
            parts.append((exp * shifted).sum(-1))
        stacked = torch.stack(parts)  # [2 or 3, N]
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        sum_exp = stacked[0]
        log_z = sum_exp.log()  # [N], log-partition of the shifted logits
        log_probs = stacked[1] - log_z  # [N]
        if compute_entropy:
            mean_z = stacked[2] / sum_exp  # [N], E_p[z] (shifted)
            entropy = log_z - mean_z
        else:
            mean_z = torch.zeros_like(log_z)
            entropy = torch.zeros_like(log_z)

        ctx.save_for_backward(shifted, log_z, mean_z, local_idx, in_slice)
        ctx.compute_entropy = compute_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor):  # type: ignore[override]
        shifted, log_z, mean_z, local_idx, in_slice = ctx.saved_tensors
        probs = (shifted - log_z.unsqueeze(-1)).exp()  # [N, Vl], this rank's slice of p
        grad = -probs * grad_log_probs.unsqueeze(-1)  # [N, Vl]
        onehot_grad = torch.where(in_slice, grad_log_probs, torch.zeros_like(grad_log_probs))
        grad.scatter_add_(-1, local_idx.unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if ctx.compute_entropy and grad_entropy is not None:
            grad = grad - probs * (shifted - mean_z.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_log_probs(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-softmax of the label token and the softmax entropy from a vocab shard.

    Args:
        logits_local: ``[N, V/tp]`` this rank's slice of the logits (any float dtype;
            computed in float32).
        labels: ``[N]`` global token ids in ``[0, V)``.
        tp_group: the tensor-parallel process group holding the other vocab slices
            (``None``: the default group).
        vocab_start: global id of this slice's first column.
        temperature: logits are divided by it before the softmax (verl's
            ``temperature``), as the sampler does.
        compute_entropy: also return the entropy.

    Returns:
        ``(log_probs [N], entropy [N] or None)``, float32, identical on all tp ranks and
        differentiable w.r.t. ``logits_local``. The caller's loss must be the same on
        every tp rank (it is: the outputs are replicated), so no gradient reduction is
        needed in backward.
    """
    if logits_local.dim() != 2 or labels.shape != logits_local.shape[:1]:
        raise ValueError(
            f"expected logits_local [N, V/tp] and labels [N], got {tuple(logits_local.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits_local.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, labels.long(), tp_group, int(vocab_start), compute_entropy
    )
    return log_probs, (entropy if compute_entropy else None)


def _vocab_start_of(logits: DTensor) -> int:
    """Global vocab offset of this rank's shard of a ``Shard(-1)`` logits DTensor."""
    # torch.chunk's split (ceil-sized shards) from the mesh coordinate alone: no tensor op, so
    # it also holds under FakeTensorMode (rlhf.simulate), where the offset helper reads a tensor.
    mesh = logits.device_mesh
    chunk = -(-logits.shape[-1] // mesh.size())
    return min(mesh.get_local_rank() * chunk, logits.shape[-1])


def log_probs_from_logits(
    logits: torch.Tensor | DTensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of ``labels`` from LM-head output.

    Args:
        logits: ``[B, T, V]`` either a plain tensor (full vocab) or the vocab-sharded
            DTensor ``apply_tp(..., loss_parallel=True)`` makes the LM head return
            (placement ``Shard(-1)`` on a 1-D tp mesh); the latter is never gathered.
        labels: ``[B, T]`` token ids aligned with ``logits`` (the caller shifts: for a
            causal LM, ``logits[:, t]`` predicts ``input_ids[:, t + 1]``).

    Returns:
        ``(log_probs [B, T], entropy [B, T] or None)`` as plain float32 tensors.
    """
    batch_shape = labels.shape
    if isinstance(logits, DTensor):
        if logits.device_mesh.ndim != 1 or logits.placements != (Shard(logits.ndim - 1),):
            raise ValueError(
                "expected vocab-sharded logits (placements (Shard(-1),) on a 1-D tp mesh), got "
                f"{logits.placements} on a {logits.device_mesh.ndim}-D mesh"
            )
        vocab_start = _vocab_start_of(logits)
        local = logits.to_local()
        group = logits.device_mesh.get_group()
    else:
        vocab_start, local, group = 0, logits, None
    if local.shape[:-1] != batch_shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(batch_shape)} disagree on [B, T]"
        )
    local = local.reshape(-1, local.shape[-1])
    if group is None:
        # Full vocab on this rank: plain log-softmax, no collectives.
        z = local.float() / temperature
        log_z = z.logsumexp(-1)
        lp = z.gather(-1, labels.reshape(-1, 1).long()).squeeze(-1) - log_z
        ent = None
        if compute_entropy:
            p = (z - log_z.unsqueeze(-1)).exp()
            ent = (log_z - (p * z).sum(-1)).reshape(batch_shape)
        return lp.reshape(batch_shape), ent
    lp, ent = vocab_parallel_log_probs(
        local,
        labels.reshape(-1),
        group,
        vocab_start=vocab_start,
        temperature=temperature,
        compute_entropy=compute_entropy,
    )
    return lp.reshape(batch_shape), (ent.reshape(batch_shape) if ent is not None else None)
