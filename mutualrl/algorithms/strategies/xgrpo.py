"""``xgrpo``: own samples only; the baseline and scale are over every policy's rewards for the prompt.

The peers' rewards are not taken as reported: each peer completion is re-scored by the learner's
own verifier and reward functions, as ``prp`` and ``sgt`` do, so a peer with another reward (or a
false one) cannot move the learner's baseline.
"""

from __future__ import annotations

from mutualrl.algorithms.registry import OWN_GROUPS, POOLED_ADVANTAGES
from mutualrl.algorithms.sharing import ShareContext, TrainBatch, pool_with_peers, register_strategy


@register_strategy("xgrpo", reads=("rollout",), needs=(OWN_GROUPS,), provides=(POOLED_ADVANTAGES,))
def xgrpo(ctx: ShareContext, batch: TrainBatch) -> None:
    """Cross-policy GRPO: advantages of own samples against the pooled group of all policies."""
    peer_rewards: list[list[float]] = []
    for g in ctx.groups:
        rows = ctx.peers.rollouts.get(g.problem.id, [])
        batch.peer_rows.update(r.source_policy for r in rows)
        texts = [r.completion for r in rows]
        peer_rewards.append(ctx.score([g.problem] * len(texts), texts)[0] if texts else [])
    pool_with_peers(ctx, batch, peer_rewards)
    batch.metrics["xgrpo_pooled_prompts"] = sum(bool(p) for p in peer_rewards)
    batch.metrics["xgrpo_peer_rewards"] = sum(map(len, peer_rewards))
