"""``prp``: peers' rollouts, retokenized by THL, join the group as off-policy rows.

Each peer row carries its THL chunks (learner token range, peer log-prob sum); the row kind's
weights turn them into truncated chunk importance weights (``sharing.prp.ratio_clip``). Rewards of
peer samples come from the learner's own verifier, and advantages are over the pooled group (own +
peer rewards).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mutualrl.algorithms.registry import OWN_GROUPS, POOLED_ADVANTAGES, RowKind
from mutualrl.algorithms.sharing import ShareContext, TrainBatch, TrainRow, pool_with_peers, register_strategy
from mutualrl.config.schema import bounded

PEER = "peer"
"""The row kind of a peer's rollout in the learner's tokens."""


@dataclass
class PRPSettings:
    """``sharing.prp``: peer rollout pooling."""

    ratio_clip: float = bounded(1.0, gt=0)
    """Truncation c of the chunk importance ratios: weight = min(ratio, c)."""
    max_per_prompt: int = bounded(4, ge=0)
    """Peer rollouts joined to each own group."""
    weight: float = bounded(0.5, ge=0)
    """Scale of a peer row's loss relative to an own row's."""


def chunk_weights(rows: Sequence[TrainRow], cur_logp: torch.Tensor, width: int, settings: PRPSettings
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights of peer rows from their THL chunk log-ratios
    ``sum(learner log-probs) - peer log-prob sum`` per chunk (1 outside chunks), with the ratios'
    statistics (mean, max, truncated share, effective sample size)."""
    clip = settings.ratio_clip
    w = torch.ones_like(cur_logp)
    ratios: list[float] = []
    idx = [i for i, row in enumerate(rows) if row.peer_chunks]
    # one device-to-host copy of the rows, then plain Python sums per chunk
    cur_rows = cur_logp[idx].detach().double().tolist() if idx else []
    for i, cur in zip(idx, cur_rows, strict=True):
        row = rows[i]
        off = width - len(row.completion_ids)
        w_row = [1.0] * width
        for a, b, peer_sum in row.peer_chunks or ():
            r = math.exp(min(math.fsum(cur[off + a:off + b]) - peer_sum, 50.0))
            ratios.append(r)
            w_row[off + a:off + b] = [min(r, clip)] * (b - a)
        w[i] = torch.tensor(w_row, dtype=w.dtype, device=w.device)
    stats: dict[str, float] = {}
    if ratios:
        t = torch.tensor(ratios, dtype=torch.float64)
        trunc = t.clamp(max=clip)
        stats = {"prp_ratio_mean": float(t.mean()), "prp_ratio_max": float(t.max()),
                 "prp_ratio_truncated_frac": float((t > clip).double().mean()),
                 "prp_ess_frac": float(trunc.sum() ** 2 / (trunc.pow(2).sum() * len(ratios)).clamp(min=1e-12))}
    return w, stats


@register_strategy("prp", settings=PRPSettings, rows={PEER: RowKind("off_policy_pg", weights=chunk_weights)},
                   reads=("rollout",), needs=(OWN_GROUPS,), provides=(POOLED_ADVANTAGES,),
                   peer_rollouts=lambda s: s.max_per_prompt)
def prp(ctx: ShareContext, batch: TrainBatch, s: PRPSettings) -> None:
    """Peer rollout pooling: re-verified peer samples train as off-policy rows."""
    if ctx.align_peer is None:
        raise RuntimeError("prp needs THL (align_peer)")
    n_peer, refused = 0, 0
    residual_sum: dict[str, float] = defaultdict(float)
    reasons: dict[str, int] = defaultdict(int)
    aligned_per_group = []
    rewards_per_group: list[list[float]] = []
    for g in ctx.groups:
        kept, aligned = [], []
        for r in ctx.peers.rollouts.get(g.problem.id, [])[: s.max_per_prompt]:
            res = ctx.align_peer(r, g.prompt_ids)
            if res.refused:
                refused += 1
                reasons[res.refused] += 1
                continue
            kept.append(r.completion)
            aligned.append((res.ids, res.chunks))
            batch.peer_rows[r.source_policy] += 1
            for k, v in res.residual.items():
                residual_sum[k] += v
                residual_sum[f"{k}/{r.source_policy}"] += v  # per tokenizer pair (this learner, that peer)
        # re-verify: the reward of a peer sample is the learner's own verifier's, never the claim
        rewards_per_group.append(ctx.score([g.problem] * len(kept), kept)[0] if kept else [])
        aligned_per_group.append(aligned)
    peer_adv = pool_with_peers(ctx, batch, rewards_per_group)
    for g, aligned, advs in zip(ctx.groups, aligned_per_group, peer_adv, strict=True):
        for (ids, chunks), a in zip(aligned, advs, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, None, PEER, chunks, s.weight))
            n_peer += 1
    batch.metrics["prp_peer_samples"] = n_peer
    batch.metrics["prp_refused"] = refused
    for reason, n in reasons.items():
        batch.metrics[f"prp_refused/{reason}"] = n
    for k, v in residual_sum.items():
        peer = k.partition("/")[2]
        batch.metrics[f"prp_thl_{k}"] = v / max(1, batch.peer_rows[peer] if peer else n_peer)
