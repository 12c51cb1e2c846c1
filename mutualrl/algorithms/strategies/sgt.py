"""``sgt``: success-gated transfer.

For prompts whose whole own group failed (GRPO's gradient there is zero), peers' verified
successes that the learner's own verifier accepts again become likelihood (rescue) rows, encoded
as the learner would emit them after its own prompt and weighted by ``sgt_lambda``.
"""

from __future__ import annotations

from collections import Counter

from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    own_success_row,
    register_strategy,
    verified_successes,
)


@register_strategy("sgt", reads=("verified_success",))
def sgt(ctx: ShareContext, batch: TrainBatch) -> None:
    """Success-gated transfer: re-verified peer successes rescue prompts the learner failed."""
    s = ctx.sharing
    tally: Counter[str] = Counter()
    rescue = gate_open = replayed = 0
    for g in ctx.groups:
        if not g.failed:
            own = own_success_row(g, s.sgt_lambda) if s.sgt_replay_own else None
            if own is not None:
                batch.rows.append(own)
                replayed += 1
            continue
        gate_open += 1
        if rescue >= s.sgt_max_per_step:
            continue
        found = next(verified_successes(ctx, g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, []),
                                        tally), None)
        if found is not None:
            batch.rows.append(TrainRow(g.prompt_ids, found[0], 0.0, None, "rescue", None, s.sgt_lambda))
            batch.peer_rows[found[2]] += 1
            rescue += 1
    batch.metrics["sgt_gate_open"] = gate_open
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["sgt_refused"] = tally["refused"]
    batch.metrics["sgt_unrepresentable"] = tally["unrepresentable"]
    if s.sgt_replay_own:
        batch.metrics["sgt_replayed_own"] = replayed
