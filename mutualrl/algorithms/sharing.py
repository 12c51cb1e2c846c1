"""Sharing strategies: how a learner turns its own group and its peers' rows into a training batch.

A strategy is a chain of named steps (``xgrpo+sgt``). Each step is one function registered with
:func:`register_strategy`, which also declares what the step needs: the record kinds it reads from
the exchange (the worker queries exactly those), whether it rewrites advantages over a pooled
group (two such steps cannot be chained) and which other steps it cannot be combined with. The
base step (``independent``: own samples, own group advantages) always runs first.

The built-in steps live in :mod:`mutualrl.algorithms.strategies` (one module each: ``prp``,
``xgrpo``, ``sgt``, ``guide``, ``imitate``); the ``mutualrl.algorithms`` package imports them,
so they are registered before anything of it is used. :func:`parse_strategy` is the one parser of a strategy name.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.config import GRPOOptions, SharingConfig
from mutualrl.experience import KINDS, GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem
from mutualrl.thl.peer import PeerTrace


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
    kind: str = "own"
    """``own`` (clipped surrogate), ``peer`` (truncated-IS policy gradient) or ``rescue`` (NLL)."""
    peer_chunks: list[tuple[int, int, float]] | None = None
    """Peer rows: (first learner token, end learner token, peer log-prob sum) per THL chunk."""
    weight: float = 1.0


@dataclass
class TrainBatch:
    """What the learner trains on this step, with the metrics its strategy steps reported."""

    rows: list[TrainRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    n_prompts: int = 0
    """Prompts of the step (own groups), the denominator of the rescue term."""
    peer_rows: Counter[str] = field(default_factory=Counter)
    """Peer rows the steps used, by peer name (a row, a pooled reward, a rescued success):
    logged as ``peer_rows`` and ``peer_rows/<peer>``."""


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
class ShareContext:
    """Everything a strategy step may read."""

    groups: list[OwnGroup]
    peers: PeerRows
    options: GRPOOptions
    sharing: SharingConfig
    score: ScoreFn
    """The learner's own reward and verifier: a peer's claim is never trusted."""
    encode_completion: EncodeFn
    align_peer: AlignFn | None = None
    history: list[PastFailure] = field(default_factory=list)
    """Earlier steps' failed prompts with peer successes, newest first (steps that ``replay``)."""


StrategyFn = Callable[[ShareContext, TrainBatch], None]


@dataclass(frozen=True)
class StrategyStep:
    """A registered strategy step and what it declares about itself."""

    name: str
    apply: StrategyFn
    reads: frozenset[str]
    """Record kinds the step reads from the exchange (``rollout``, ``group_outcome``, ``verified_success``)."""
    pools_advantages: bool
    """The step recomputes advantages over a group pooled with peers (at most one such step)."""
    conflicts: frozenset[str]
    """Steps it cannot be chained with (the relation is symmetric)."""
    description: str = ""
    replays: bool = False
    """The step reads :attr:`ShareContext.history` (peer successes of earlier failed prompts)."""
    trains_peer_rollouts: bool = False
    """The step adds peers' rollouts to the learner's update (the resource plan prices them)."""


_REGISTRY: dict[str, StrategyStep] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
BASE = "independent"


def register_strategy(name: str, *, reads: Sequence[str] = (), pools_advantages: bool = False,
                      conflicts: Sequence[str] = (), description: str = "", replays: bool = False,
                      trains_peer_rollouts: bool = False) -> Callable[[StrategyFn], StrategyFn]:
    """Register a strategy step under ``name`` (usable in ``sharing.strategy``, chained with '+').

    ``reads`` names the record kinds the step needs: the learner queries the exchange for exactly
    the union of its steps' kinds. A name can be registered once; a second registration raises
    ``ValueError`` (use another name).
    """
    if not _NAME.match(name):
        raise ValueError(f"strategy name {name!r} must be lower-case letters, digits and '_', starting with a letter")
    bad = sorted(set(reads) - set(KINDS))
    if bad:
        raise ValueError(f"strategy {name!r} reads unknown record kinds {bad}; known: {list(KINDS)}")

    def deco(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered (by {_REGISTRY[name].apply.__module__}); "
                             "choose another name")
        _REGISTRY[name] = StrategyStep(name, fn, frozenset(reads), pools_advantages, frozenset(conflicts),
                                       description or (fn.__doc__ or "").strip().split("\n")[0], replays,
                                       trains_peer_rollouts)
        return fn

    return deco


def available_strategies() -> list[str]:
    """Names of every registered step."""
    return sorted(_REGISTRY)


class StrategyError(ValueError):
    """A strategy name that does not parse; the message says why and what is valid."""


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: the sharing steps after the base step, in order."""

    steps: tuple[StrategyStep, ...]

    @property
    def name(self) -> str:
        return "+".join(s.name for s in self.steps) or BASE

    @property
    def reads(self) -> frozenset[str]:
        """Record kinds to query from peers (empty: the learner reads nothing)."""
        return frozenset().union(*(s.reads for s in self.steps))

    @property
    def trains_peer_rollouts(self) -> bool:
        """Whether a step trains on peers' rollouts (their cost belongs in the learner's update)."""
        return any(s.trains_peer_rollouts for s in self.steps)

    @property
    def replays(self) -> bool:
        """Whether a step reads earlier steps' failed prompts (:attr:`ShareContext.history`)."""
        return any(s.replays for s in self.steps)

    @property
    def shares(self) -> bool:
        return bool(self.steps)


def parse_strategy(spec: str | Strategy) -> Strategy:
    """Parse ``independent`` or a chain of sharing steps such as ``xgrpo+sgt``.

    Raises :class:`StrategyError` for an unknown step (with the closest name), a step named twice,
    ``independent`` in a chain, two steps that both pool advantages, or a declared conflict.
    """
    if isinstance(spec, Strategy):
        return spec
    parts = [p.strip() for p in str(spec).split("+")]
    for p in parts:
        if p not in _REGISTRY:
            close = difflib.get_close_matches(p, list(_REGISTRY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StrategyError(f"unknown strategy {p!r}{hint}; available: {', '.join(available_strategies())} "
                                "(combine with '+')")
    if len(set(parts)) != len(parts):
        raise StrategyError(f"strategy {spec!r} names a step twice")
    if BASE in parts:
        if len(parts) > 1:
            raise StrategyError(f"{BASE!r} cannot be combined with sharing steps")
        return Strategy(())
    steps = tuple(_REGISTRY[p] for p in parts)
    pooling = [s.name for s in steps if s.pools_advantages]
    if len(pooling) > 1:
        raise StrategyError(f"{' and '.join(map(repr, pooling))} both pool advantages over peers; "
                            "chain at most one of them (e.g. with 'sgt')")
    for a in steps:
        for b in steps:
            if b.name in a.conflicts:
                raise StrategyError(f"{a.name!r} cannot be combined with {b.name!r}")
    return Strategy(steps)


def check_strategy_name(spec: str) -> str | None:
    """The error message of :func:`parse_strategy` for ``spec``, or None if it is valid."""
    try:
        parse_strategy(spec)
    except StrategyError as exc:
        return str(exc)
    return None


def build_batch(strategy: str | Strategy, ctx: ShareContext) -> TrainBatch:
    """Run the base step, then each step of ``strategy`` in order.

    With ``dynamic_sampling`` on, rows whose advantage is zero (groups without reward variance)
    are left out at the end, after every step had its say (XGRPO can give such a group a signal).
    """
    batch = TrainBatch(n_prompts=len(ctx.groups))
    _independent(ctx, batch)
    for step in parse_strategy(strategy).steps:
        step.apply(ctx, batch)
    if ctx.options.dynamic_sampling != "off":
        keep = [r for r in batch.rows if r.kind == "rescue" or abs(r.advantage) > 1e-12]
        batch.metrics["zero_adv_rows_skipped"] = len(batch.rows) - len(keep)
        batch.rows = keep
    if ctx.peers.any() or batch.peer_rows:
        batch.metrics["peer_rows"] = sum(batch.peer_rows.values())
        offered = ctx.peers.by_source()
        for name in sorted(set(offered) | set(batch.peer_rows)):
            batch.metrics[f"peer_rows/{name}"] = batch.peer_rows[name]
            batch.metrics[f"peer_offered/{name}"] = offered.get(name, 0)
    return batch


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


def own_success_row(group: OwnGroup, weight: float) -> TrainRow | None:
    """A likelihood row of the learner's own best completion of a group it solved (self-imitation:
    a supervised step that sees the learner's own skill beside what peers give it), or None."""
    if group.failed or not group.completion_ids:
        return None
    best = max(range(len(group.scores)), key=group.scores.__getitem__)
    return TrainRow(group.prompt_ids, list(group.completion_ids[best]), 0.0, None, "rescue", None, weight)


def batch_std(ctx: ShareContext, extra: Sequence[float] = ()) -> float:
    """Unbiased std of the step's own rewards plus ``extra`` (the peer rewards a strategy pools)."""
    rewards = [r for g in ctx.groups for r in g.rewards] + list(extra)
    if len(rewards) < 2:
        return 0.0
    m = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1))


def own_rows_by_prompt(batch: TrainBatch, groups: list[OwnGroup]) -> list[list[TrainRow]]:
    """The base step's own rows, one list per group (in group order)."""
    own = [r for r in batch.rows if r.kind == "own"]
    out, i = [], 0
    for g in groups:
        n = len(g.completion_ids)
        out.append(own[i:i + n])
        i += n
    return out


@register_strategy(BASE)
def _independent(ctx: ShareContext, batch: TrainBatch) -> None:
    """Plain GRPO: own samples, own group advantages."""
    bstd = batch_std(ctx)
    zero_var = 0
    for g in ctx.groups:
        adv = pooled_advantages(g.rewards, g.rewards, ctx.options.scale_rewards, bstd)
        zero_var += not g.informative
        for ids, lp, a in zip(g.completion_ids, g.logprobs, adv, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, lp, "own"))
    batch.metrics["zero_var_group_frac"] = zero_var / max(1, len(ctx.groups))

