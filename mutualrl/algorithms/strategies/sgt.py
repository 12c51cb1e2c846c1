"""``sgt``: success-gated transfer.

For prompts whose whole own group failed (GRPO's gradient there is zero), peers' verified
successes that the learner's own verifier accepts again become likelihood (rescue) rows, encoded
as the learner would emit them after its own prompt and weighted by ``sharing.sgt.weight``
(the paper's lambda); with ``learning_rate`` they train in an AdamW step of their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mutualrl.algorithms.registry import RowKind
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    own_success_row,
    register_strategy,
    verified_successes,
)
from mutualrl.config.schema import bounded

RESCUE = "rescue"
"""The row kind of a rescued prompt's re-verified peer success (and, with ``replay_own``, of the
learner's own successes)."""


@dataclass
class SGTSettings:
    """``sharing.sgt``: success-gated transfer."""

    weight: float = bounded(0.1, ge=0)
    """lambda: the weight of each rescue row's length-normalised likelihood term."""
    max_rows: int = bounded(16, ge=0)
    """Rescue rows per learner per step, at most."""
    replay_own: bool = False
    """Also put one of the learner's own verified successes per solved prompt into the rescue rows
    (self-distillation next to the peer's: a supervised step on peer successes alone makes a small
    model forget its own skill)."""
    learning_rate: float | None = bounded(None, gt=0)
    """Train the rescue rows in an optimizer step of their own (AdamW at this learning rate, after
    the GRPO step): supervised rows tolerate a larger step than the policy gradient. None: they join
    the GRPO step."""


@register_strategy("sgt", settings=SGTSettings,
                   rows={RESCUE: RowKind("likelihood", learning_rate=lambda s: s.learning_rate)},
                   reads=("verified_success",))
def sgt(ctx: ShareContext, batch: TrainBatch, s: SGTSettings) -> None:
    """Success-gated transfer: re-verified peer successes rescue prompts the learner failed."""
    tally: Counter[str] = Counter()
    rescue = gate_open = replayed = 0
    for g in ctx.groups:
        if not g.failed:
            own = own_success_row(g, s.weight, RESCUE) if s.replay_own else None
            if own is not None:
                batch.rows.append(own)
                replayed += 1
            continue
        gate_open += 1
        if rescue >= ctx.rank_share(s.max_rows):
            continue
        found = next(verified_successes(ctx, g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, []),
                                        tally), None)
        if found is not None:
            batch.rows.append(TrainRow(g.prompt_ids, found[0], 0.0, None, RESCUE, None, s.weight))
            batch.peer_rows[found[2]] += 1
            rescue += 1
    batch.metrics["sgt_gate_open"] = gate_open
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["sgt_refused"] = tally["refused"]
    batch.metrics["sgt_unrepresentable"] = tally["unrepresentable"]
    if s.replay_own:
        batch.metrics["sgt_replayed_own"] = replayed
