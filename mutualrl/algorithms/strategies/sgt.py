"""``sgt``: success-gated transfer.

For prompts whose whole own group failed (GRPO's gradient there is zero), peers' verified
successes that the learner's own verifier accepts again become likelihood (rescue) rows, encoded
as the learner would emit them after its own prompt and weighted by ``sgt_lambda``.
"""

from __future__ import annotations

from mutualrl.algorithms.sharing import ShareContext, TrainBatch, TrainRow, register_strategy
from mutualrl.tasks.base import SUCCESS_THRESHOLD


@register_strategy("sgt", reads=("verified_success",))
def sgt(ctx: ShareContext, batch: TrainBatch) -> None:
    """Success-gated transfer: re-verified peer successes rescue prompts the learner failed."""
    s = ctx.sharing
    rescue, refused, gate_open = 0, 0, 0
    replayed = 0
    for g in ctx.groups:
        if not g.failed:
            if s.sgt_replay_own and g.texts:
                best = max(range(len(g.scores)), key=g.scores.__getitem__)
                batch.rows.append(TrainRow(g.prompt_ids, list(g.completion_ids[best]), 0.0, None, "rescue", None,
                                           s.sgt_lambda))
                replayed += 1
            continue
        gate_open += 1
        if rescue >= s.sgt_max_per_step:
            continue
        for succ in ctx.peers.successes.get(g.problem.id, []):
            # the learner's own verifier decides; a peer's claim of success is only a hint
            if ctx.score([g.problem], [succ.completion])[1][0] < SUCCESS_THRESHOLD:
                refused += 1
                continue
            ids = ctx.encode_completion(g.prompt_ids, succ.completion)
            batch.rows.append(TrainRow(g.prompt_ids, ids, 0.0, None, "rescue", None, s.sgt_lambda))
            rescue += 1
            break
    batch.metrics["sgt_gate_open"] = gate_open
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["sgt_refused"] = refused
    if s.sgt_replay_own:
        batch.metrics["sgt_replayed_own"] = replayed
