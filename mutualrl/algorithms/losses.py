"""Loss terms: registered pure functions from one kind of row's tensors to a per-token loss.

A sharing step declares, for every kind of training row it adds, the term that trains it by name
(:class:`~mutualrl.algorithms.sharing.RowKind`); the update computes each kind's term and sums them,
knowing no strategy. Like verl's ``register_policy_loss``, a new objective is one decorated function::

    @register_loss("my_term", reduction="per_prompt")
    def my_term(x: TermInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return -x.logp * x.row_weight.unsqueeze(1), {}

A term returns the loss of every token (``[B, C]``, right-aligned like the rows; positions outside
``mask`` are ignored) and its statistics. The update *reduces* it with the term's declared reduction
over counts of the whole batch (:class:`BatchCounts`: every kind of that reduction, and, when a
policy trains on several data-parallel ranks, every rank), so the sum of the terms kind by kind is
the loss of one pass over the whole batch:

- ``policy_gradient``: GRPO's aggregation ``loss_type`` (TRL's names): ``grpo`` (each row's mean,
  summed, over the sequences), ``bnpo`` / ``dapo`` / ``token_mean`` (summed over the tokens),
  ``dr_grpo`` (summed over sequences x ``max_completion_length``).
- ``per_prompt``: summed over the step's prompts (SGT's rescue term: each row weighs ``lambda``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mutualrl.algorithms.batch import BatchCounts
from mutualrl.config import GRPOOptions

Reduction = Literal["policy_gradient", "per_prompt"]
REDUCTIONS: tuple[str, ...] = ("policy_gradient", "per_prompt")


@dataclass(frozen=True)
class TermInputs:
    """One kind of row of a batch as right-aligned tensors (``[B, C]``; ``[B]`` per row)."""

    logp: torch.Tensor
    """Log-probs of the completion tokens under the current weights (with gradient)."""
    mask: torch.Tensor
    """Positions holding completion tokens."""
    advantages: torch.Tensor
    row_weight: torch.Tensor
    options: GRPOOptions
    old_logp: torch.Tensor | None = None
    """The PPO reference: the trainer's own log-probs before the first optimizer step on the batch."""
    ref_logp: torch.Tensor | None = None
    """The frozen reference's log-probs (for the KL penalty; ``beta`` > 0)."""
    token_weight: torch.Tensor | None = None
    """A per-token coefficient without gradient: the kind's importance weights (off-policy rows) or
    the sampler/trainer mismatch correction (own rows)."""
    token_advantages: torch.Tensor | None = None
    """Dense per-token advantages ``[B, C]`` added to :attr:`advantages` (zero on padding; None: none)."""

    def advantage(self) -> torch.Tensor:
        """The per-token advantage ``[B, C]`` (or ``[B, 1]``): the row's plus its dense part."""
        adv = self.advantages.unsqueeze(1)
        return adv if self.token_advantages is None else adv + self.token_advantages


TermFn = Callable[[TermInputs], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LossTerm:
    """A registered loss term and what it declares."""

    name: str
    fn: TermFn
    reduction: Reduction
    needs_reference: bool
    """The term reads :attr:`TermInputs.old_logp` (on-policy rows: the clipped ratio)."""
    uses_kl: bool
    """The term adds the KL penalty (``beta`` > 0 computes the frozen reference's log-probs for it)."""


_TERMS: dict[str, LossTerm] = {}


def register_loss(name: str, *, reduction: Reduction, needs_reference: bool = False,
                  uses_kl: bool = False) -> Callable[[TermFn], TermFn]:
    """Register ``fn`` as loss term ``name`` (a name is registered once)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")

    def deco(fn: TermFn) -> TermFn:
        if name in _TERMS:
            raise ValueError(f"loss term {name!r} is already registered (by {_TERMS[name].fn.__module__})")
        _TERMS[name] = LossTerm(name, fn, reduction, needs_reference, uses_kl)
        return fn

    return deco


def loss_term(name: str) -> LossTerm:
    """The registered term ``name`` (``KeyError`` naming the registered ones)."""
    try:
        return _TERMS[name]
    except KeyError:
        raise KeyError(f"unknown loss term {name!r}; registered: {', '.join(sorted(_TERMS))}") from None


def registered_losses() -> list[str]:
    """Names of every registered loss term."""
    return sorted(_TERMS)


def reduce(per_token: torch.Tensor, mask: torch.Tensor, reduction: Reduction, counts: BatchCounts,
           options: GRPOOptions) -> torch.Tensor:
    """A term's per-token loss reduced to its share of the batch loss (see the module docstring)."""
    m = mask.to(per_token.dtype)
    if reduction == "per_prompt":
        return (per_token * m).sum() / max(1, counts.prompts)
    lt = options.loss_type
    if lt == "grpo":
        per_seq = (per_token * m).sum(1) / m.sum(1).clamp(min=1.0)
        return per_seq.sum() / max(1, counts.sequences)
    if lt in ("bnpo", "dapo", "token_mean"):
        return (per_token * m).sum() / max(1, counts.tokens)
    if lt == "dr_grpo":
        return (per_token * m).sum() / (max(1, counts.sequences) * options.max_completion_length)
    raise ValueError(f"loss_type must be grpo, bnpo, dapo, dr_grpo or token_mean, got {lt!r}")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def _kl(x: TermInputs) -> torch.Tensor | None:
    if x.options.beta <= 0:
        return None
    if x.ref_logp is None:
        raise ValueError("beta > 0 needs the reference log-probs (ref_logp)")
    return k3_kl(x.logp, x.ref_logp)


def kl_stat(kl: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """``{"kl": mean of the per-token KL over mask}`` (0 without a KL penalty)."""
    if kl is None:
        return {"kl": 0.0}
    m = mask.float()
    return {"kl": float((kl.detach() * m).sum() / m.sum().clamp(min=1.0))}


@register_loss("clipped_surrogate", reduction="policy_gradient", needs_reference=True, uses_kl=True)
def clipped_surrogate(x: TermInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped surrogate on on-policy rows: ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``
    with ``r`` the ratio to the PPO reference, plus ``beta`` x k3 KL; scaled by the row weight and
    the mismatch correction."""
    if x.old_logp is None:
        raise ValueError("clipped_surrogate needs the PPO reference log-probs (old_logp)")
    o = x.options
    eps_hi = o.epsilon if o.epsilon_high is None else o.epsilon_high
    adv = x.advantage()
    ratio = torch.exp(x.logp - x.old_logp)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - o.epsilon, 1.0 + eps_hi) * adv)
    kl = _kl(x)
    if kl is not None:
        per_token = per_token + o.beta * kl
    per_token = per_token * x.row_weight.unsqueeze(1)
    if x.token_weight is not None:
        per_token = per_token * x.token_weight
    with torch.no_grad():
        m = x.mask.float()
        n = m.sum().clamp(min=1.0)
        clipped = ((ratio < 1.0 - o.epsilon) & (adv < 0)) | ((ratio > 1.0 + eps_hi) & (adv > 0))
        stats = {"clip_frac": float((clipped.float() * m).sum() / n), "ratio_mean": float((ratio * m).sum() / n),
                 **kl_stat(kl, x.mask)}
    return per_token, stats


@register_loss("off_policy_pg", reduction="policy_gradient", uses_kl=True)
def off_policy_pg(x: TermInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy gradient of off-policy rows (peer samples): ``-w A exp(logp - stopgrad(logp))``,
    whose gradient is ``w A grad logp`` with ``w`` the kind's truncated importance weight (no clip),
    plus ``beta`` x k3 KL; scaled by the row weight."""
    w = x.token_weight if x.token_weight is not None else torch.ones_like(x.logp)
    per_token = -(w * torch.exp(x.logp - x.logp.detach()) * x.advantage())
    kl = _kl(x)
    if kl is not None:
        per_token = per_token + x.options.beta * kl
    return per_token * x.row_weight.unsqueeze(1), kl_stat(kl, x.mask)


@register_loss("likelihood", reduction="per_prompt")
def likelihood(x: TermInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Length-normalised negative log-likelihood of each row, weighted by its row weight (SGT's
    ``lambda``): reduced over the step's prompts, ``sum_rows lambda * NLL / prompts``."""
    m = x.mask.to(x.logp.dtype)
    lengths = m.sum(1, keepdim=True).clamp(min=1.0)
    per_token = -x.logp / lengths * x.row_weight.unsqueeze(1)
    with torch.no_grad():
        nll = -(x.logp * m).sum(1) / lengths.squeeze(1)
    return per_token, {"nll": float(nll.mean()) if nll.numel() else 0.0}
