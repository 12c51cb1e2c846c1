"""``xgrpo``: own samples only; the baseline and scale are over every policy's rewards for the prompt."""

from __future__ import annotations

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    batch_std,
    own_rows_by_prompt,
    register_strategy,
)


@register_strategy("xgrpo", reads=("group_outcome",), pools_advantages=True)
def xgrpo(ctx: ShareContext, batch: TrainBatch) -> None:
    """Cross-policy GRPO: advantages of own samples against the pooled group of all policies."""
    # the batch scale, like the baseline, is over every policy's rewards (own-only could be 0)
    bstd = batch_std(ctx, [r for g in ctx.groups for o in ctx.peers.outcomes.get(g.problem.id, [])
                           for r in o.rewards])
    pooled_prompts, peer_rewards = 0, 0
    for g, rows in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), strict=True):
        peers = [r for o in ctx.peers.outcomes.get(g.problem.id, []) for r in o.rewards]
        if not peers:
            continue
        pooled_prompts += 1
        peer_rewards += len(peers)
        adv = pooled_advantages(g.rewards, list(g.rewards) + peers, ctx.options.scale_rewards, bstd)
        for row, a in zip(rows, adv, strict=True):
            row.advantage = a
    batch.metrics["xgrpo_pooled_prompts"] = pooled_prompts
    batch.metrics["xgrpo_peer_rewards"] = peer_rewards
