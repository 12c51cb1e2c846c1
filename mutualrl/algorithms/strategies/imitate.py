"""``imitate``: success-gated transfer with a replay of earlier steps' rescues.

Like ``sgt``, peers' verified successes (re-verified by the learner's own verifier) become
likelihood rows for prompts whose whole own group failed. ``sgt`` sees only this step's prompts,
so a learner gets a handful of rescue rows a step; ``imitate`` also replays peer successes for
prompts the learner failed in the last ``replay_steps`` steps (read back from the exchange: no
extra rollouts), newest first, up to ``sgt_max_per_step`` rows: a larger, steadier supervised
batch on the skill the learner lacks (self-imitation learning, with the peers' successes).
"""

from __future__ import annotations

from collections import Counter

from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    register_strategy,
    verified_successes,
)


@register_strategy("imitate", reads=("verified_success",), conflicts=("sgt",), replays=True)
def imitate(ctx: ShareContext, batch: TrainBatch) -> None:
    """Replayed success-gated transfer: this step's and recent steps' peer successes rescue failed prompts."""
    s = ctx.sharing
    candidates = [(g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, []))
                  for g in ctx.groups if g.failed]
    fresh = len(candidates)
    candidates += [(h.problem, h.prompt_ids, h.successes) for h in ctx.history]
    seen: set[str] = set()
    tally: Counter[str] = Counter()
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
        replayed += k >= fresh
    batch.metrics["sgt_gate_open"] = fresh
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["imitate_replayed"] = replayed
    batch.metrics["sgt_refused"] = tally["refused"]
    batch.metrics["sgt_unrepresentable"] = tally["unrepresentable"]
