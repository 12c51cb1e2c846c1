"""``xgrpo``: own samples only; the baseline and scale are over every policy's rewards for the prompt.

The peers' rewards are not taken as reported: each peer completion is re-scored by the learner's
own verifier and reward functions, as ``prp`` and ``sgt`` do, so a peer with another reward (or a
false one) cannot move the learner's baseline.
"""

from __future__ import annotations

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    batch_std,
    own_rows_by_prompt,
    register_strategy,
)


@register_strategy("xgrpo", reads=("rollout",), pools_advantages=True)
def xgrpo(ctx: ShareContext, batch: TrainBatch) -> None:
    """Cross-policy GRPO: advantages of own samples against the pooled group of all policies."""
    peer_rewards: list[list[float]] = []
    for g in ctx.groups:
        rows = ctx.peers.rollouts.get(g.problem.id, [])
        batch.peer_rows.update(r.source_policy for r in rows)
        texts = [r.completion for r in rows]
        peer_rewards.append(ctx.score([g.problem] * len(texts), texts)[0] if texts else [])
    # the batch scale, like the baseline, is over every policy's rewards (own-only could be 0)
    bstd = batch_std(ctx, [r for rs in peer_rewards for r in rs])
    pooled_prompts = 0
    for g, rows, peers in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), peer_rewards, strict=True):
        if not peers:
            continue
        pooled_prompts += 1
        adv = pooled_advantages(g.rewards, list(g.rewards) + peers, ctx.options.scale_rewards, bstd)
        for row, a in zip(rows, adv, strict=True):
            row.advantage = a
    batch.metrics["xgrpo_pooled_prompts"] = pooled_prompts
    batch.metrics["xgrpo_peer_rewards"] = sum(map(len, peer_rewards))
