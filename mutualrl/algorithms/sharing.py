"""Sharing strategies: how a learner turns its own group and its peers' rows into a training batch.

A strategy is a chain of named steps (``xgrpo+sgt``); each step is one function registered with
:func:`register_strategy` that reads a :class:`ShareContext` and edits a :class:`TrainBatch`.
The base (``independent``) step always runs first: own samples, own group advantages.

- ``independent``: plain GRPO on own samples.
- ``xgrpo``: own samples only; baseline and scale over every policy's rewards for the prompt.
- ``prp``: peers' rollouts, retokenized by THL, join the group as off-policy rows with truncated
  THL chunk importance weights; advantages over the pooled group.
- ``sgt``: for prompts whose whole own group failed, peers' verified successes that the learner's
  own verifier accepts again become likelihood (rescue) rows, weighted by ``sgt_lambda``.
"""

from __future__ import annotations

import difflib
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.algorithms.grpo import pooled_advantages
from mutualrl.config import GRPOOptions, SharingConfig
from mutualrl.experience import GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem, Task


@dataclass
class OwnGroup:
    """The learner's own group for one prompt."""

    problem: Problem
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    scores: list[float]

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
    rows: list[TrainRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PeerRows:
    """Peers' rows for this step's prompts, grouped by prompt id."""

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
        return out


@dataclass
class ShareContext:
    """Everything a strategy step may read."""

    groups: list[OwnGroup]
    peers: PeerRows
    task: Task
    options: GRPOOptions
    sharing: SharingConfig
    encode_completion: Callable[[str, bool], list[int]]
    """Learner's retokenization of a completion text (text, add_eos) -> ids."""
    align_peer: Callable[[Rollout], tuple[list[int], list[tuple[int, int, float]], dict[str, float]] | None] | None = None
    """THL: a peer rollout -> (learner completion ids, chunks, residual metrics), None if refused."""


StrategyFn = Callable[[ShareContext, TrainBatch], None]
_REGISTRY: dict[str, StrategyFn] = {}


def register_strategy(name: str) -> Callable[[StrategyFn], StrategyFn]:
    """Register a strategy step under ``name`` (usable in ``sharing.strategy``, joined by '+')."""

    def deco(fn: StrategyFn) -> StrategyFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def check_strategy_name(spec: str) -> str | None:
    """An error message if ``spec`` is not a valid strategy (chain), else None."""
    parts = [p.strip() for p in spec.split("+")]
    for p in parts:
        if p not in _REGISTRY:
            close = difflib.get_close_matches(p, list(_REGISTRY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"unknown strategy {p!r}{hint}; available: {', '.join(available_strategies())} (combine with '+')"
    if len(set(parts)) != len(parts):
        return f"strategy {spec!r} names a step twice"
    if "independent" in parts and len(parts) > 1:
        return "'independent' cannot be combined with sharing steps"
    if "prp" in parts and "xgrpo" in parts:
        return "'prp' already pools advantages over peers; combine it with 'sgt', not 'xgrpo'"
    return None


def build_batch(spec: str, ctx: ShareContext) -> TrainBatch:
    """Run the base step and then each step of ``spec`` in order."""
    batch = TrainBatch()
    _independent(ctx, batch)
    for part in (p.strip() for p in spec.split("+")):
        if part != "independent":
            _REGISTRY[part](ctx, batch)
    return batch


def _batch_std(ctx: ShareContext, extra: Sequence[float] = ()) -> float:
    """Unbiased std of the step's own rewards plus ``extra`` (the peer rewards a strategy pools)."""
    rewards = [r for g in ctx.groups for r in g.rewards] + list(extra)
    if len(rewards) < 2:
        return 0.0
    m = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1))


@register_strategy("independent")
def _independent(ctx: ShareContext, batch: TrainBatch) -> None:
    bstd = _batch_std(ctx)
    zero_var = 0
    for g in ctx.groups:
        adv = pooled_advantages(g.rewards, g.rewards, ctx.options.scale_rewards, bstd)
        if max(g.rewards) - min(g.rewards) < 1e-12:
            zero_var += 1
        for ids, lp, a in zip(g.completion_ids, g.logprobs, adv, strict=True):
            batch.rows.append(TrainRow(g.prompt_ids, ids, a, lp, "own"))
    batch.metrics["zero_var_group_frac"] = zero_var / max(1, len(ctx.groups))


def _own_rows_by_prompt(batch: TrainBatch, groups: list[OwnGroup]) -> list[list[TrainRow]]:
    own = [r for r in batch.rows if r.kind == "own"]
    out, i = [], 0
    for g in groups:
        n = len(g.completion_ids)
        out.append(own[i:i + n])
        i += n
    return out


@register_strategy("xgrpo")
def _xgrpo(ctx: ShareContext, batch: TrainBatch) -> None:
    # the batch scale, like the baseline, is over every policy's rewards (own-only could be 0)
    bstd = _batch_std(ctx, [r for g in ctx.groups for o in ctx.peers.outcomes.get(g.problem.id, [])
                            for r in o.rewards])
    pooled_prompts, peer_rewards = 0, 0
    for g, rows in zip(ctx.groups, _own_rows_by_prompt(batch, ctx.groups), strict=True):
        peers = [r for o in ctx.peers.outcomes.get(g.problem.id, []) for r in o.rewards]
        if not peers:
            continue
        pooled_prompts += 1
        peer_rewards += len(peers)
        adv = pooled_advantages(g.rewards, list(g.rewards) + peers, ctx.options.scale_rewards, bstd)
        for row, a in zip(rows, adv, strict=True):
            row.advantage = a
    batch.metrics["xgrpo_pooled_prompts"] = pooled_prompts
    batch.metrics["xgrpo_peer_rewards"] = peer_rewards


@register_strategy("prp")
def _prp(ctx: ShareContext, batch: TrainBatch) -> None:
    s = ctx.sharing
    n_peer, refused = 0, 0
    residual_sum: dict[str, float] = defaultdict(float)
    if ctx.align_peer is None:
        raise RuntimeError("prp needs THL (align_peer)")
    per_group = []
    for g in ctx.groups:
        peer_rolls = ctx.peers.rollouts.get(g.problem.id, [])[: s.prp_max_peer_per_prompt]
        aligned = []
        for r in peer_rolls:
            # re-verify: the reward of a peer sample is the learner's own verifier's, never the claim
            res = ctx.align_peer(r)
            if res is None:
                refused += 1
                continue
            reward, _ = ctx.task.rewards([g.problem], [g.problem.question], [r.completion])
            aligned.append((res, reward[0]))
            for k, v in res[2].items():
                residual_sum[k] += v
        per_group.append(aligned)
    # the batch scale is over the pooled batch (own + peer rewards), like the baseline
    bstd = _batch_std(ctx, [rw for aligned in per_group for _, rw in aligned])
    for g, rows, aligned in zip(ctx.groups, _own_rows_by_prompt(batch, ctx.groups), per_group, strict=True):
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
    for k, v in residual_sum.items():
        batch.metrics[f"prp_thl_{k}"] = v / max(1, n_peer)


@register_strategy("sgt")
def _sgt(ctx: ShareContext, batch: TrainBatch) -> None:
    s = ctx.sharing
    rescue, refused, gate_open = 0, 0, 0
    for g in ctx.groups:
        if not g.failed:
            continue
        gate_open += 1
        if rescue >= s.sgt_max_per_step:
            continue
        for succ in ctx.peers.successes.get(g.problem.id, []):
            # the learner's own verifier decides; a peer's claim of success is only a hint
            if ctx.task.verify(g.problem, succ.completion) < SUCCESS_THRESHOLD:
                refused += 1
                continue
            ids = ctx.encode_completion(succ.completion, True)
            batch.rows.append(TrainRow(g.prompt_ids, ids, 0.0, None, "rescue", None, s.sgt_lambda))
            rescue += 1
            break
    batch.metrics["sgt_gate_open"] = gate_open
    batch.metrics["sgt_rescue"] = rescue
    batch.metrics["sgt_refused"] = refused
