"""``prp``: peers' rollouts, retokenized by THL, join the group as off-policy rows.

Each peer row carries its THL chunks (learner token range, peer log-prob sum); the update turns
them into truncated chunk importance weights. Rewards of peer samples come from the learner's own
verifier, and advantages are over the pooled group (own + peer rewards).
"""

from __future__ import annotations

from collections import defaultdict

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    batch_std,
    own_rows_by_prompt,
    register_strategy,
)


@register_strategy("prp", reads=("rollout",), pools_advantages=True, trains_peer_rollouts=True)
def prp(ctx: ShareContext, batch: TrainBatch) -> None:
    """Peer rollout pooling: re-verified peer samples train as off-policy rows."""
    s = ctx.sharing
    n_peer, refused = 0, 0
    residual_sum: dict[str, float] = defaultdict(float)
    if ctx.align_peer is None:
        raise RuntimeError("prp needs THL (align_peer)")
    per_group = []
    reasons: dict[str, int] = defaultdict(int)
    for g in ctx.groups:
        kept, aligned = [], []
        for r in ctx.peers.rollouts.get(g.problem.id, [])[: s.prp_max_peer_per_prompt]:
            res = ctx.align_peer(r, g.prompt_ids)
            if res.refused:
                refused += 1
                reasons[res.refused] += 1
                continue
            kept.append(r.completion)
            aligned.append((res.ids, res.chunks, res.residual))
            batch.peer_rows[r.source_policy] += 1
            for k, v in res.residual.items():
                residual_sum[k] += v
                residual_sum[f"{k}/{r.source_policy}"] += v  # per tokenizer pair (this learner, that peer)
        # re-verify: the reward of a peer sample is the learner's own verifier's, never the claim
        rewards = ctx.score([g.problem] * len(kept), kept)[0] if kept else []
        per_group.append(list(zip(aligned, rewards, strict=True)))
    # the batch scale is over the pooled batch (own + peer rewards), like the baseline
    bstd = batch_std(ctx, [rw for aligned in per_group for _, rw in aligned])
    for g, rows, aligned in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), per_group, strict=True):
        if not aligned:
            continue
        pool = list(g.rewards) + [rw for _, rw in aligned]
        own_adv = pooled_advantages(g.rewards, pool, ctx.options.scale_rewards, bstd)
        for row, a in zip(rows, own_adv, strict=True):
            row.advantage = a
        peer_adv = pooled_advantages([rw for _, rw in aligned], pool, ctx.options.scale_rewards, bstd)
        for ((ids, chunks, _), _rw), a in zip(aligned, peer_adv, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, None, "peer", chunks, s.prp_peer_weight))
            n_peer += 1
    batch.metrics["prp_peer_samples"] = n_peer
    batch.metrics["prp_refused"] = refused
    for reason, n in reasons.items():
        batch.metrics[f"prp_refused/{reason}"] = n
    for k, v in residual_sum.items():
        peer = k.partition("/")[2]
        batch.metrics[f"prp_thl_{k}"] = v / max(1, batch.peer_rows[peer] if peer else n_peer)
