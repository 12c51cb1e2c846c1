"""``imitate``: success imitation with peers: a supervised step on a mixture of the peers' verified
successes where the learner failed and its own where it succeeded.

SGT's rescue rows are peer successes alone: a supervised step on them alone pulls the learner
towards the skill it lacks and away from the one it has (on the zoo the partner lost 5-14 points of
its own skill). ``imitate`` keeps SGT's gate and re-verification for the peer rows (prompts whose
whole own group failed; the learner's own verifier accepts the peer's answer again; text the
learner cannot write is refused) and adds, for every prompt the learner solved, its own best
completion (self-imitation learning, Oh et al. 2018): the step then sees both skills in the
proportion the learner meets them, like the warm start's mixture, and the own skill is rehearsed
instead of overwritten. With ``replay_steps`` it also replays peer successes for prompts the
learner failed in the last steps (read back from the exchange: no extra rollouts). Rows are
weighted by ``sgt_lambda`` and trained in the rescue optimizer (``sgt_learning_rate``) when one is
set; the peer rows are capped at ``sgt_max_per_step``, the own rows are one per solved prompt.
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


@register_strategy("imitate", reads=("verified_success",), conflicts=("sgt",), replays=True)
def imitate(ctx: ShareContext, batch: TrainBatch) -> None:
    """Success imitation: peer successes where the learner failed, its own where it succeeded."""
    s = ctx.sharing
    tally: Counter[str] = Counter()
    own_rows = [row for g in ctx.groups if (row := own_success_row(g, s.sgt_lambda)) is not None]
    failed = [(g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, [])) for g in ctx.groups if g.failed]
    candidates = failed + [(h.problem, h.prompt_ids, h.successes) for h in ctx.history]
    seen: set[str] = set()
    rescue = replayed = 0
    for k, (problem, prompt_ids, successes) in enumerate(candidates):
        if rescue >= s.sgt_max_per_step:
            break
        if problem.id in seen:
            continue
        found = next(verified_successes(ctx, problem, prompt_ids, successes, tally), None)
        if found is None:
            continue
        batch.rows.append(TrainRow(prompt_ids, found[0], 0.0, None, "rescue", None, s.sgt_lambda))
        batch.peer_rows[found[2]] += 1
        seen.add(problem.id)
        rescue += 1
        replayed += k >= len(failed)
    batch.rows.extend(own_rows)
    batch.metrics["sgt_gate_open"] = len(failed)
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["imitate_own"] = len(own_rows)
    batch.metrics["imitate_replayed"] = replayed
    batch.metrics["sgt_refused"] = tally["refused"]
    batch.metrics["sgt_unrepresentable"] = tally["unrepresentable"]


@register_strategy("self_imitate", conflicts=("sgt", "imitate"))
def self_imitate(ctx: ShareContext, batch: TrainBatch) -> None:
    """The control of ``imitate``: its own-success rows alone, no peer row (what self-imitation gives
    without sharing)."""
    rows = [row for g in ctx.groups if (row := own_success_row(g, ctx.sharing.sgt_lambda)) is not None]
    batch.rows.extend(rows)
    batch.metrics["imitate_own"] = len(rows)
