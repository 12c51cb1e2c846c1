"""``guide``: peers' verified successes join the learner's group where its own group failed (AMPO).

A group in which every own sample failed carries no GRPO signal. Here up to
``sharing.guide.max_per_group`` peer successes, re-verified by the learner's own verifier and
encoded as the learner would emit them after its own prompt, join that group; advantages are
computed over the pooled group, so the peer success gets a large positive, normalised advantage
and the learner's own failures a negative one. The peer rows train off-policy: ``A * grad log p``
per token, optionally shaped as in LUFFY (``shaping_gamma``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mutualrl.algorithms.registry import OWN_GROUPS, POOLED_ADVANTAGES, RowKind
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    pool_with_peers,
    register_strategy,
    verified_successes,
)
from mutualrl.config.schema import bounded

GUIDE = "guide"
"""The row kind of a guiding peer success."""


@dataclass
class GuideSettings:
    """``sharing.guide``: AMPO-style guidance."""

    max_per_group: int = bounded(1, ge=1)
    """Peer successes put into each guided group."""
    gate: float = bounded(0.0, ge=0, lt=1)
    """Guide a group whose own success rate is at most this (0: only groups where every own sample
    failed, AMPO's gate)."""
    weight: float = bounded(1.0, ge=0)
    """Scale of a guiding row's loss relative to an own row's."""
    shaping_gamma: float = bounded(0.0, ge=0)
    """LUFFY's policy shaping ``f(p) = p / (p + gamma)`` on the guiding tokens (0: none, the plain
    policy gradient ``A * grad log p``)."""


def shaping_weights(rows: Sequence[TrainRow], cur_logp: torch.Tensor, width: int, settings: GuideSettings
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """LUFFY's policy shaping as a per-token weight on ``grad log p``: the gradient of
    ``f(p) = p / (p + gamma)`` is ``gamma * p / (p + gamma)**2 * grad log p``; ``gamma = 0`` gives 1."""
    gamma = settings.shaping_gamma
    if gamma <= 0:
        return torch.ones_like(cur_logp), {}
    p = cur_logp.detach().exp()
    return gamma * p / (p + gamma) ** 2, {}


@register_strategy("guide", settings=GuideSettings, rows={GUIDE: RowKind("off_policy_pg", weights=shaping_weights)},
                   reads=("verified_success",), needs=(OWN_GROUPS,), provides=(POOLED_ADVANTAGES,))
def guide(ctx: ShareContext, batch: TrainBatch, s: GuideSettings) -> None:
    """Guided GRPO: re-verified peer successes join the learner's failed groups."""
    picked: list[list[tuple[list[int], float, str]]] = []
    tally: Counter[str] = Counter()
    for g in ctx.groups:
        found = verified_successes(ctx, g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, []), tally)
        gated = g.failed or g.success_rate <= s.gate
        picked.append(list(itertools.islice(found, s.max_per_group)) if gated else [])
    peer_adv = pool_with_peers(ctx, batch, [[r for _, r, _ in rows] for rows in picked])
    guided = 0
    for g, rows, advs in zip(ctx.groups, picked, peer_adv, strict=True):
        for (ids, _, peer), a in zip(rows, advs, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, None, GUIDE, None, s.weight))
            batch.peer_rows[peer] += 1
            guided += 1
    batch.metrics["guide_rows"] = guided
    batch.metrics["guide_groups"] = sum(bool(r) for r in picked)
    batch.metrics["guide_refused"] = tally["refused"]
    batch.metrics["guide_unrepresentable"] = tally["unrepresentable"]
