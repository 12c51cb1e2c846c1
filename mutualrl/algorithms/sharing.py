"""Sharing: how a learner turns its own groups and its peers' rows into a training batch.

A strategy is a chain of registered steps (``xgrpo+sgt``; :mod:`mutualrl.algorithms.registry`
declares what a step is and parses a name). The base step (``independent``: own samples, own
group advantages) always runs first; each sharing step then adds rows of its own kinds and may
rewrite own advantages. This module holds what the steps read and write: the learner's own groups
(:class:`OwnGroup`), the peers' rows in fair order (:class:`PeerRows`), the context
(:class:`ShareContext`), the batch (:class:`TrainBatch` of :class:`TrainRow`), the helpers the
built-in steps share (re-verification, the pooled advantages) and :func:`build_batch`.

The built-in steps live in :mod:`mutualrl.algorithms.strategies` (one module each: ``prp``,
``xgrpo``, ``sgt``, ``guide``, ``imitate`` and ``self_imitate``); the ``mutualrl.algorithms``
package imports them, so they are registered before anything of it is used.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from mutualrl.experience import GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem
from mutualrl.thl.peer import PeerTrace

if TYPE_CHECKING:
    from mutualrl.config import GRPOOptions

__all__ = ["BASE", "OWN", "BoundKind", "OwnGroup", "PastFailure", "PastSuccess", "PeerRows", "RowKind", "ShareContext", "Strategy",
           "StrategyError", "StrategyStep", "TrainBatch", "TrainRow", "available_strategies", "build_batch",
           "check_strategy_name", "fair_order", "own_rows_by_prompt", "own_success_row", "parse_strategy",
           "pool_with_peers", "register_strategy", "trained_tokens", "trains", "verified_successes"]


@dataclass
class OwnGroup:
    """The learner's own group for one prompt."""

    problem: Problem
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    scores: list[float]
    texts: list[str] = field(default_factory=list)
    """The decoded completions (what peers receive)."""

    @property
    def informative(self) -> bool:
        """True when the rewards differ (the group carries a GRPO signal)."""
        return max(self.rewards) - min(self.rewards) > 1e-12

    @property
    def success_rate(self) -> float:
        """The share of the group's samples that succeeded."""
        return sum(sc >= SUCCESS_THRESHOLD for sc in self.scores) / max(1, len(self.scores))

    @property
    def failed(self) -> bool:
        """True when no completion reached the success threshold (GRPO's signal may vanish)."""
        return max(self.scores) < SUCCESS_THRESHOLD


@dataclass
class TrainRow:
    """One row of the learner's training batch, in the learner's own tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    old_logprobs: list[float] | None = None
    """Behavior log-probs (own rows). Peer rows carry ``peer_chunks`` instead."""
    kind: str = OWN
    """The row's kind: ``own`` (the base step's) or one a step of the strategy declares, which
    names the loss term that trains it (:class:`~mutualrl.algorithms.registry.RowKind`)."""
    peer_chunks: list[tuple[int, int, float]] | None = None
    """Peer rows: (first learner token, end learner token, peer log-prob sum) per THL chunk."""
    weight: float = 1.0


def _base_kinds() -> dict[str, BoundKind]:
    return parse_strategy(BASE).kinds()


@dataclass
class TrainBatch:
    """What the learner trains on this step, with the metrics its strategy steps reported."""

    rows: list[TrainRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    n_prompts: int = 0
    """Prompts of the step (own groups), the denominator of ``per_prompt`` loss terms."""
    peer_rows: Counter[str] = field(default_factory=Counter)
    """Peer rows the steps used, by peer name (a row, a pooled reward, a rescued success):
    logged as ``peer_rows`` and ``peer_rows/<peer>``."""
    kinds: dict[str, BoundKind] = field(default_factory=_base_kinds)
    """Every row kind the strategy's steps declare, bound to their settings (what the update reads)."""


@dataclass
class PeerRows:
    """Peers' rows for this step's prompts, grouped by prompt id, each list in *fair order*.

    The exchange returns rows oldest first and peer by peer; a step that takes the first ``n``
    rows of a prompt would then only ever hear the first-published peer, and stale rows before
    fresh ones. :meth:`from_records` orders each prompt's rows newest version first within each
    peer and interleaves the peers round-robin, starting from a peer that rotates with the prompt
    (a hash of its id), so a cap of one row per prompt still spreads over every peer.
    """

    rollouts: dict[str, list[Rollout]] = field(default_factory=lambda: defaultdict(list))
    outcomes: dict[str, list[GroupOutcome]] = field(default_factory=lambda: defaultdict(list))
    successes: dict[str, list[VerifiedSuccess]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def from_records(cls, records: Sequence[Any]) -> PeerRows:
        out = cls()
        for r in records:
            if isinstance(r, Rollout):
                out.rollouts[r.prompt_id].append(r)
            elif isinstance(r, GroupOutcome):
                out.outcomes[r.prompt_id].append(r)
            elif isinstance(r, VerifiedSuccess):
                out.successes[r.prompt_id].append(r)
        for table in (out.rollouts, out.outcomes, out.successes):
            for pid, rows in table.items():
                table[pid] = fair_order(pid, rows)
        return out

    def any(self) -> bool:
        """Whether any peer row arrived."""
        return bool(self.rollouts or self.outcomes or self.successes)

    def by_source(self) -> Counter[str]:
        """Rows that arrived, by peer (every kind)."""
        counts: Counter[str] = Counter()
        for table in (self.rollouts, self.outcomes, self.successes):
            for rows in table.values():
                counts.update(r.source_policy for r in rows)
        return counts


def fair_order(prompt_id: str, rows: Sequence[Any]) -> list[Any]:
    """``rows`` of one prompt newest first within each peer, the peers interleaved round-robin from
    a starting peer that rotates with ``prompt_id`` (deterministic)."""
    by_peer: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        by_peer[r.source_policy].append(r)
    if len(by_peer) <= 1:
        return sorted(rows, key=lambda r: -r.version)
    names = sorted(by_peer)
    start = int(hashlib.sha1(prompt_id.encode("utf-8", "surrogatepass")).hexdigest()[:8], 16) % len(names)
    queues = [sorted(by_peer[n], key=lambda r: -r.version) for n in names[start:] + names[:start]]
    return [r for level in itertools.zip_longest(*queues) for r in level if r is not None]


ScoreFn = Callable[[Sequence[Problem], Sequence[str]], tuple[list[float], list[float]]]
"""(problems, completions) -> (rewards, verifier scores): the learner's one scoring path."""
EncodeFn = Callable[[Sequence[int], str], list[int] | None]
"""(learner prompt ids, completion text) -> the learner's ids of the text after that prompt, EOS last;
None when the learner's tokenizer cannot represent the text (it would not decode back to it)."""
AlignFn = Callable[[Rollout, Sequence[int]], PeerTrace]
"""(peer rollout, learner prompt ids) -> the rollout in the learner's tokens (THL), or why not."""


@dataclass
class PastFailure:
    """A prompt of an earlier step on which the learner's whole group failed, with the peers'
    verified successes for it (what ``imitate`` replays)."""

    problem: Problem
    prompt_ids: list[int]
    successes: list[VerifiedSuccess]
    version: int


@dataclass
class PastSuccess:
    """A prompt of an earlier step the learner solved, with one of its own verified successes (what
    ``self_imitate`` replays with ``extra_rows``)."""

    problem: Problem
    prompt_ids: list[int]
    completion: str
    version: int


@dataclass
class ShareContext:
    """Everything a strategy step may read (its settings come as its own argument)."""

    groups: list[OwnGroup]
    peers: PeerRows
    options: GRPOOptions
    score: ScoreFn
    """The learner's own reward and verifier: a peer's claim is never trusted."""
    encode_completion: EncodeFn
    align_peer: AlignFn | None = None
    history: list[PastFailure] = field(default_factory=list)
    """Earlier steps' failed prompts with peer successes, newest first (steps that declare
    ``replay_steps``)."""
    own_history: list[PastSuccess] = field(default_factory=list)
    """Earlier steps' solved prompts with one own verified success each, newest first (likewise)."""
    world: int = 1
    """How many data-parallel ranks share the policy's step (``policies[i].workers``): the groups
    here are this rank's part of the step's prompts."""
    sum_over_ranks: Callable[[Sequence[float]], list[float]] | None = None
    """Element-wise sum over the ranks (:meth:`~mutualrl.run.distributed.RankGroup.sum`; None: one rank)."""

    def rank_share(self, per_step: int) -> int:
        """This rank's part of a per-step cap (``max_rows``, ``match_tokens``): the cap over the
        ranks, rounded up, so the ranks together take what one worker would."""
        return per_step if self.world <= 1 else -(-per_step // self.world)


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
    """Whether ``row`` will train: a policy-gradient row of zero advantage is left out under
    ``dynamic_sampling`` (its group had no reward variance); every other row trains."""
    return (options.dynamic_sampling == "off" or batch.kinds[row.kind].term.reduction != "policy_gradient"
            or abs(row.advantage) > 1e-12)


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
