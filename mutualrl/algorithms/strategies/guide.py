"""``guide``: peers' verified successes join the learner's group where its own group failed (AMPO).

A group in which every own sample failed carries no GRPO signal. Here up to
``guide_max_per_group`` peer successes, re-verified by the learner's own verifier and encoded as
the learner would emit them after its own prompt, join that group; advantages are computed over
the pooled group, so the peer success gets a large positive, normalised advantage and the
learner's own failures a negative one. The peer rows train off-policy: ``A * grad log p`` per
token, optionally shaped as in LUFFY (``guide_shaping_gamma``).
"""

from __future__ import annotations

import itertools
from collections import Counter

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    batch_std,
    own_rows_by_prompt,
    register_strategy,
    verified_successes,
)


@register_strategy("guide", reads=("verified_success",), pools_advantages=True)
def guide(ctx: ShareContext, batch: TrainBatch) -> None:
    """Guided GRPO: re-verified peer successes join the learner's failed groups."""
    s = ctx.sharing
    picked: list[list[tuple[list[int], float, str]]] = []
    tally: Counter[str] = Counter()
    for g in ctx.groups:
        found = verified_successes(ctx, g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, []), tally)
        gated = g.failed or g.success_rate <= s.guide_gate
        picked.append(list(itertools.islice(found, s.guide_max_per_group)) if gated else [])
    bstd = batch_std(ctx, [r for rows in picked for _, r, _ in rows])
    guided = 0
    for g, own, rows in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), picked, strict=True):
        if not rows:
            continue
        pool = list(g.rewards) + [r for _, r, _ in rows]
        for row, a in zip(own, pooled_advantages(g.rewards, pool, ctx.options.scale_rewards, bstd), strict=True):
            row.advantage = a
        peer_adv = pooled_advantages([r for _, r, _ in rows], pool, ctx.options.scale_rewards, bstd)
        for (ids, _, peer), a in zip(rows, peer_adv, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, None, "guide", None, s.guide_weight))
            batch.peer_rows[peer] += 1
            guided += 1
    batch.metrics["guide_rows"] = guided
    batch.metrics["guide_groups"] = sum(bool(r) for r in picked)
    batch.metrics["guide_refused"] = tally["refused"]
    batch.metrics["guide_unrepresentable"] = tally["unrepresentable"]
