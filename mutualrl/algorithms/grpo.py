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

from mutualrl.algorithms.losses import (
    BatchCounts,
    TermInputs,
    clipped_surrogate,
    k3_kl,
    kl_stat,
    off_policy_pg,
    reduce,
)
from mutualrl.config import GRPOOptions

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


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Reduce a masked ``[B, C]`` per-token loss of one batch to a scalar per ``loss_type``
    (:func:`mutualrl.algorithms.losses.reduce` with the batch's own counts)."""
    counts = BatchCounts(per_token.shape[0], int(mask.sum()), 0)
    return reduce(per_token, mask, "policy_gradient", counts,
                  GRPOOptions(loss_type=loss_type, max_completion_length=max_completion_length))  # type: ignore[arg-type]


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
    """The GRPO loss over one batch of rows (tensors ``[B, C]`` right-aligned, ``advantages [B]``):
    the registered terms ``clipped_surrogate`` (on-policy rows) and ``off_policy_pg`` (``offpolicy``
    rows) reduced together by ``loss_type``, as the update does for a batch's policy-gradient rows.

    Args:
        logp: current log-probs (with gradient).
        old_logp: log-probs of the policy that produced the samples (no gradient).
        advantages: one advantage per row.
        mask: which positions hold completion tokens.
        is_weight: per-token truncated importance weights for off-policy rows.
        offpolicy: ``[B]`` bool, rows that use ``is_weight`` instead of the clipped ratio.
        row_weight: ``[B]`` scale of each row's loss (e.g. peer samples' weight).
        token_weight: ``[B, C]`` scale of each on-policy token's loss (the truncated importance
            correction of a sampler/trainer mismatch, ``min(pi_train / pi_sampler, cap)``; no gradient).
    """
    opts = GRPOOptions(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,  # type: ignore[arg-type]
                       max_completion_length=max_completion_length)
    rw = row_weight if row_weight is not None else torch.ones(logp.shape[0], dtype=logp.dtype, device=logp.device)
    on = TermInputs(logp, mask, advantages, rw, opts, old_logp=old_logp, ref_logp=ref_logp, token_weight=token_weight)
    per_token, _ = clipped_surrogate(on)
    onpol_mask = mask
    if offpolicy is not None and bool(offpolicy.any()):
        if is_weight is None:
            raise ValueError("offpolicy rows need is_weight")
        off = offpolicy.unsqueeze(1)
        pg, _ = off_policy_pg(TermInputs(logp, mask, advantages, rw, opts, ref_logp=ref_logp, token_weight=is_weight))
        per_token = torch.where(off, pg, per_token)
        onpol_mask = mask & ~off
    _, stats = clipped_surrogate(TermInputs(logp.detach(), onpol_mask, advantages, rw, opts, old_logp=old_logp,
                                            ref_logp=ref_logp))
    stats["kl"] = kl_stat(k3_kl(logp, ref_logp) if beta > 0 and ref_logp is not None else None, mask)["kl"]
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    return LossOutput(aggregate(per_token, mask, loss_type, max_completion_length), stats)


def sequence_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised negative log-likelihood per row: -sum(logp) / len."""
    m = mask.to(logp.dtype)
    return -(logp * m).sum(1) / m.sum(1).clamp(min=1.0)
