"""Sharing: how a learner turns its own groups and its peers' rows into a training batch.

A strategy is a chain of registered steps (``xgrpo+sgt``; :mod:`mutualrl.algorithms.registry`
declares what a step is and parses a name). The base step (``independent``: own samples, own
group advantages) always runs first; each sharing step then adds rows of its own kinds and may
rewrite own advantages. What the steps read is in :mod:`mutualrl.algorithms.context` (the
learner's own groups, the peers' rows, :class:`ShareContext`), what they write in
:mod:`mutualrl.algorithms.batch`; this module is a step author's one import: those names, the
helpers the built-in steps share (re-verification, the pooled advantages), :func:`gather_context`
(each step's ``gather`` hook) and :func:`build_batch`.

The built-in steps live in :mod:`mutualrl.algorithms.strategies` (one module each: ``prp``,
``xgrpo``, ``sgt``, ``guide``, ``imitate`` and ``self_imitate``); the ``mutualrl.algorithms``
package imports them, so they are registered before anything of it is used.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from mutualrl.algorithms.batch import TrainBatch, TrainRow
from mutualrl.algorithms.context import (
    AlignFn,
    EncodeFn,
    OwnGroup,
    PeerRows,
    ScoreFn,
    ShareContext,
    StepSource,
    fair_order,
)
from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.algorithms.registry import (
    BASE,
    OWN,
    OWN_GROUPS,
    BoundKind,
    RowKind,
    Strategy,
    StrategyError,
    StrategyStep,
    available_strategies,
    check_strategy_name,
    parse_strategy,
    register_strategy,
)
from mutualrl.experience import VerifiedSuccess
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem

if TYPE_CHECKING:
    from mutualrl.config import GRPOOptions

__all__ = ["BASE", "OWN", "AlignFn", "BoundKind", "EncodeFn", "OwnGroup", "PeerRows", "RowKind", "ScoreFn",
           "ShareContext", "StepSource", "Strategy", "StrategyError", "StrategyStep", "TrainBatch", "TrainRow",
           "available_strategies", "build_batch", "check_strategy_name", "fair_order", "gather_context",
           "own_rows_by_prompt", "own_success_row", "parse_strategy", "pool_with_peers", "register_strategy", "serve_peers",
           "trained_tokens", "trains", "verified_successes"]


def _hooks(strategy: str | Strategy, hook: str, sharing: Any) -> list[tuple[str, Callable[..., Any], Any]]:
    """``(step name, its hook, its settings)`` for each step of ``strategy`` that declares ``hook``."""
    strat = parse_strategy(strategy)
    settings = strat.settings(sharing)
    return [(s.name, getattr(s, hook), settings.get(s.name)) for s in strat.steps if getattr(s, hook) is not None]


def serve_peers(strategy: str | Strategy, source: StepSource, sharing: Any = None
                ) -> tuple[list[Any], dict[str, float]]:
    """Run each ``serve`` hook of ``strategy`` (the work for the peers between the rollouts and the
    updates): the records to publish and the metrics, summed over the steps."""
    records: list[Any] = []
    metrics: dict[str, float] = {}
    for _, serve, settings in _hooks(strategy, "serve", sharing):
        rows, m = serve(source, settings)
        records += rows
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    return records, metrics


def gather_context(strategy: str | Strategy, source: StepSource, sharing: Any = None) -> dict[str, Any]:
    """What each step of ``strategy`` that declares a ``gather`` hook fetches for the step (through
    ``source``), by step name: the :attr:`ShareContext.gathered` of the step (a hook that returns
    None leaves its step out)."""
    gathered = {name: gather(source, settings) for name, gather, settings in _hooks(strategy, "gather", sharing)}
    return {name: got for name, got in gathered.items() if got is not None}


def build_batch(strategy: str | Strategy, ctx: ShareContext, sharing: Any = None) -> TrainBatch:
    """Run the base step, then each step of ``strategy`` in its order, each with its settings
    (``sharing``: a :class:`~mutualrl.config.SharingConfig`, a mapping of step name to a settings
    block or instance, or None for the defaults).

    With ``dynamic_sampling`` on, policy-gradient rows whose advantage is zero (groups without
    reward variance) are left out at the end, after every step had its say (XGRPO can give such a
    group a signal). A row of a kind no step of the strategy declares is an error (a bug in a step).
    """
    strat = parse_strategy(strategy)
    settings = strat.settings(sharing)
    batch = TrainBatch(n_prompts=len(ctx.groups), kinds=strat.kinds(settings))
    for step in strat.all_steps:
        step.run(ctx, batch, settings.get(step.name))
    undeclared = sorted({r.kind for r in batch.rows} - set(batch.kinds))
    if undeclared:
        raise StrategyError(f"strategy {strat.name!r} added rows of undeclared kinds {undeclared}; a step declares "
                            "the kinds it adds (register_strategy(rows=...))")
    if ctx.options.dynamic_sampling != "off":
        keep = [r for r in batch.rows if trains(r, batch, ctx.options)]
        batch.metrics["zero_adv_rows_skipped"] = len(batch.rows) - len(keep)
        batch.rows = keep
    if ctx.peers.any() or batch.peer_rows:
        batch.metrics["peer_rows"] = sum(batch.peer_rows.values())
        offered = ctx.peers.by_source()
        for name in sorted(set(offered) | set(batch.peer_rows)):
            batch.metrics[f"peer_rows/{name}"] = batch.peer_rows[name]
            batch.metrics[f"peer_offered/{name}"] = offered.get(name, 0)
    return batch


def trains(row: TrainRow, batch: TrainBatch, options: GRPOOptions) -> bool:
    """Whether ``row`` will train: a policy-gradient row of zero advantage (and no token-level one) is
    left out under ``dynamic_sampling`` (its group had no reward variance); every other row trains."""
    return (options.dynamic_sampling == "off" or batch.kinds[row.kind].term.reduction != "policy_gradient"
            or abs(row.advantage) > 1e-12 or any(abs(a) > 1e-12 for a in row.token_advantages or ()))


def trained_tokens(batch: TrainBatch, options: GRPOOptions) -> int:
    """The completion tokens of the rows of ``batch`` that will train (:func:`trains`)."""
    return sum(len(r.completion_ids) for r in batch.rows if trains(r, batch, options))


def verified_successes(ctx: ShareContext, problem: Problem, prompt_ids: Sequence[int],
                       successes: Iterable[VerifiedSuccess], tally: Counter[str]
                       ) -> Iterator[tuple[list[int], float, str]]:
    """The peer successes the learner's own verifier accepts again, in the learner's tokens:
    ``(ids, reward, peer)`` one by one. A peer's claim of success is only a hint: ``tally["refused"]``
    counts those the verifier rejects, ``tally["unrepresentable"]`` those the learner's tokenizer
    cannot write (they would train on unknown tokens)."""
    for succ in successes:
        rewards, scores = ctx.score([problem], [succ.completion])
        if scores[0] < SUCCESS_THRESHOLD:
            tally["refused"] += 1
            continue
        ids = ctx.encode_completion(prompt_ids, succ.completion)
        if ids is None:
            tally["unrepresentable"] += 1
            continue
        yield ids, rewards[0], succ.source_policy


def own_success_row(group: OwnGroup, weight: float, kind: str) -> TrainRow | None:
    """A likelihood row (of ``kind``) of the learner's own best completion of a group it solved
    (self-imitation: a supervised step that sees the learner's own skill beside what peers give it),
    or None."""
    if group.failed or not group.completion_ids:
        return None
    best = max(range(len(group.scores)), key=group.scores.__getitem__)
    return TrainRow(group.prompt_ids, list(group.completion_ids[best]), 0.0, None, kind, None, weight)


def batch_std(ctx: ShareContext, extra: Sequence[float] = ()) -> float:
    """Unbiased std of the step's own rewards plus ``extra`` (the peer rewards a strategy pools),
    over every rank's part of the step when the policy has several."""
    rewards = [r for g in ctx.groups for r in g.rewards] + list(extra)
    if ctx.sum_over_ranks is not None:  # the moments of every rank's rewards
        n, total, squares = ctx.sum_over_ranks([len(rewards), math.fsum(rewards), math.fsum(r * r for r in rewards)])
        return math.sqrt(max(0.0, squares - total * total / n) / (n - 1)) if n >= 2 else 0.0
    if len(rewards) < 2:
        return 0.0
    m = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1))


def own_rows_by_prompt(batch: TrainBatch, groups: list[OwnGroup]) -> list[list[TrainRow]]:
    """The base step's own rows, one list per group (in group order; what ``own_groups`` promises)."""
    own = [r for r in batch.rows if r.kind == OWN]
    out, i = [], 0
    for g in groups:
        n = len(g.completion_ids)
        out.append(own[i:i + n])
        i += n
    return out


def pool_with_peers(ctx: ShareContext, batch: TrainBatch, peer_rewards: Sequence[Sequence[float]]
                    ) -> list[list[float]]:
    """Pool each group with the peers' rewards for its prompt (``peer_rewards``, one list per group,
    re-scored by the learner; empty: the group stays as it is): the own rows' advantages are
    recomputed over the pooled group, the batch scale over every own and peer reward. Returns the
    peer rewards' advantages, one list per group. The one pooling of ``xgrpo``, ``prp`` and ``guide``."""
    bstd = batch_std(ctx, [r for rs in peer_rewards for r in rs])
    scale = ctx.options.scale_rewards
    out: list[list[float]] = []
    for g, own, peers in zip(ctx.groups, own_rows_by_prompt(batch, ctx.groups), peer_rewards, strict=True):
        if not peers:
            out.append([])
            continue
        pool = list(g.rewards) + list(peers)
        for row, a in zip(own, pooled_advantages(g.rewards, pool, scale, bstd), strict=True):
            row.advantage = a
        out.append(pooled_advantages(list(peers), pool, scale, bstd))
    return out


@register_strategy(BASE, rows={OWN: RowKind("clipped_surrogate")}, provides=(OWN_GROUPS,))
def _independent(ctx: ShareContext, batch: TrainBatch) -> None:
    """Plain GRPO: own samples, own group advantages."""
    bstd = batch_std(ctx)
    zero_var = 0
    for g in ctx.groups:
        adv = pooled_advantages(g.rewards, g.rewards, ctx.options.scale_rewards, bstd)
        zero_var += not g.informative
        for ids, lp, a in zip(g.completion_ids, g.logprobs, adv, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, lp, OWN))
    batch.metrics["zero_var_group_frac"] = zero_var / max(1, len(ctx.groups))
