"""GRPO: group-relative advantages and the clipped surrogate loss.

Conventions (TRL-compatible names): ``scale_rewards`` in {group, batch, none}; ``epsilon`` /
``epsilon_high`` clip the ratio to ``[1 - epsilon, 1 + epsilon_high]``; k3 KL
``exp(ref - logp) - (ref - logp) - 1`` weighted by ``beta``; aggregation ``loss_type`` in
{grpo (per-sequence mean, then mean over sequences), bnpo / dapo / token_mean (mean over all tokens
of the batch), dr_grpo (sum over tokens / (sequences x max_completion_length))}.

Off-policy rows (PRP peer samples) do not use the PPO clip: their per-token coefficient is a
*truncated importance weight* ``w`` computed by the strategy from THL chunk ratios, and their
surrogate is ``w * A * exp(logp - stopgrad(logp))`` whose gradient is ``w * A * grad logp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ADV_EPS = 1e-4


def pooled_advantages(own: Sequence[float], pool: Sequence[float], scale_rewards: str = "group",
                      batch_std: float | None = None) -> list[float]:
    """Advantages of ``own`` rewards against the baseline/scale of a pooled reward set.

    ``pool`` holds every reward the baseline is computed over (own rewards included). For
    ``scale_rewards='batch'`` pass the batch std as ``batch_std``.
    """
    p = torch.tensor(list(pool), dtype=torch.float64)
    o = torch.tensor(list(own), dtype=torch.float64)
    centred = o - p.mean()
    if scale_rewards == "group":
        std = p.std() if p.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        centred = centred / (std + ADV_EPS)
    elif scale_rewards == "batch":
        centred = centred / ((batch_std or 0.0) + ADV_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return centred.tolist()


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: dict[str, float]


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Reduce a masked ``[B, C]`` per-token loss to a scalar per ``loss_type``."""
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        per_seq = (per_token * m).sum(1) / m.sum(1).clamp(min=1.0)
        return per_seq.mean()
    if loss_type in ("bnpo", "dapo", "token_mean"):  # one process: the batch's tokens are all the tokens
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"loss_type must be grpo, bnpo, dapo, dr_grpo or token_mean, got {loss_type!r}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    loss_type: str = "dr_grpo",
    max_completion_length: int = 1,
    is_weight: torch.Tensor | None = None,
    offpolicy: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
) -> LossOutput:
    """The GRPO loss over a batch of rows (tensors ``[B, C]`` right-aligned, ``advantages [B]``).

    Args:
        logp: current log-probs (with gradient).
        old_logp: log-probs of the policy that produced the samples (no gradient).
        advantages: one advantage per row.
        mask: which positions hold completion tokens.
        is_weight: per-token truncated importance weights for off-policy rows.
        offpolicy: ``[B]`` bool, rows that use ``is_weight`` instead of the clipped ratio.
        row_weight: ``[B]`` scale of each row's loss (e.g. peer samples' weight).
        token_weight: ``[B, C]`` scale of each token's loss (the truncated importance correction of a
            sampler/trainer mismatch, ``min(pi_train / pi_sampler, cap)``; no gradient).
    """
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_hi) * adv
    per_token = -torch.min(surr1, surr2)
    clipped = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + eps_hi) & (adv > 0))
    onpol_mask = mask
    if offpolicy is not None and bool(offpolicy.any()):
        if is_weight is None:
            raise ValueError("offpolicy rows need is_weight")
        off = offpolicy.unsqueeze(1)
        pg = -(is_weight * torch.exp(logp - logp.detach()) * adv)
        per_token = torch.where(off, pg, per_token)
        onpol_mask = mask & ~off
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
    else:
        kl = None
    if row_weight is not None:
        per_token = per_token * row_weight.unsqueeze(1)
    if token_weight is not None:
        per_token = per_token * token_weight
    loss = aggregate(per_token, mask, loss_type, max_completion_length)
    with torch.no_grad():
        m = onpol_mask.float()
        n_on = m.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float((clipped.float() * m).sum() / n_on),
            "ratio_mean": float((ratio * m).sum() / n_on),
            "kl": float((kl * mask.float()).sum() / mask.float().sum().clamp(min=1.0)) if kl is not None else 0.0,
        }
    return LossOutput(loss, stats)


def sequence_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised negative log-likelihood per row: -sum(logp) / len."""
    m = mask.to(logp.dtype)
    return -(logp * m).sum(1) / m.sum(1).clamp(min=1.0)
