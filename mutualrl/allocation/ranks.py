"""The ranks of the run's policies as a scheduler sees them: which worker processes (or actors) make
up each policy, and how their replies become one reply per policy.

A scheduler runs one worker per rank (``plan.workers``, policy by policy) and answers the
controller per policy: a call on policy ``i`` goes to every rank of ``i`` (they meet in collectives,
so all must take part) and the ranks' replies are merged by :func:`merge_replies`. A policy of one
worker is a layout of one rank and its reply passes through unchanged.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mutualrl.config.resolve import RunPlan

FIRST_KEYS: frozenset[str] = frozenset({"resample_rounds", "learning_rate", "lr", "micro_batch_tokens"})
"""Metrics every rank reports alike (decided together): the first rank's is kept."""


def merge_metrics(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's step metrics from its ranks' (each over its share of the step's prompts).

    - the same on every rank (a joint decision or a state they share after the summed gradient:
      :data:`FIRST_KEYS`, ``*grad_norm``, ``*optimizer_steps``): rank 0's;
    - wall times (``*_s``), memory (``*_mb``) and ``*_max``: the largest (the slowest rank sets the step);
      ``*_min``: the smallest;
    - losses (``*loss``: each rank's is its rows' share of the step's loss) and counts (integers:
      tokens, rows, records, counters): summed;
    - every other float (rates, means, accuracies): the unweighted mean of the ranks' (exact when
      the ranks hold equal shares of the prompts, an approximation otherwise).
    """
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        vals = [p[key] for p in parts if key in p]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
        if not numbers or key in FIRST_KEYS or key.endswith(("grad_norm", "optimizer_steps")):
            out[key] = vals[0]
        elif key.endswith(("_s", "_mb", "_max")):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        elif key.endswith("loss") or all(isinstance(v, int) for v in vals):
            out[key] = sum(vals)
        else:
            out[key] = statistics.fmean(vals)
    return out


def merge_replies(method: str, parts: Sequence[Any]) -> Any:
    """One policy's reply to ``method`` from its ranks' replies (rank order)."""
    if len(parts) == 1:
        return parts[0]
    if method in ("rollout", "update"):
        return merge_metrics(parts)
    if method == "exchange_discard_after":  # each rank drops what is left; together: every row once
        return sum(int(p) for p in parts)
    if method == "exchange_position":
        return max(int(p) for p in parts)
    if method in ("info", "__init__"):
        return {**parts[0], "rank_pids": [p.get("pid") for p in parts], "ranks": len(parts)}
    return parts[0]  # evaluate (the ranks agree on the counts), save, load, set_threads, nice


@dataclass
class RankLayout:
    """Which workers (positions in ``plan.workers``) are each policy's ranks."""

    members: list[list[int]]
    """Per policy, its workers' positions in rank order."""
    labels: list[str] = field(default_factory=list)
    """Per worker: the policy's name, with the rank when the policy has several."""

    @classmethod
    def of(cls, plan: RunPlan) -> RankLayout:
        members: list[list[int]] = [[] for _ in plan.config.policies]
        for pos, spec in enumerate(plan.workers):
            members[spec.index].append(pos)
        return cls(members, [w.label for w in plan.workers])

    @property
    def policies(self) -> int:
        return len(self.members)

    def policy_of(self, worker: int) -> int:
        """The policy a worker belongs to."""
        return next(i for i, ws in enumerate(self.members) if worker in ws)

    def merge(self, method: str, replies: Sequence[Any]) -> list[Any]:
        """Per policy, its ranks' replies (``replies`` by worker position) merged."""
        return [merge_replies(method, [replies[w] for w in ws]) for ws in self.members]

    def total(self, index: int, per_worker: dict[int, float | None]) -> float | None:
        """A policy's sum of a per-worker measure (CPU seconds), None if a rank's is unknown."""
        vals = [per_worker.get(w) for w in self.members[index]]
        return None if any(v is None for v in vals) else float(sum(vals))  # type: ignore[arg-type]


@dataclass
class PendingReplies:
    """Replies of submitted calls arriving rank by rank; a policy's is complete when all its ranks answered."""

    layout: RankLayout
    got: dict[int, dict[int, Any]] = field(default_factory=dict)

    def add(self, worker: int, reply: Any) -> int | None:
        """Record ``worker``'s reply; the policy index when that completes the policy's, else None."""
        i = self.layout.policy_of(worker)
        self.got.setdefault(i, {})[worker] = reply
        return i if len(self.got[i]) == len(self.layout.members[i]) else None

    def pop(self, index: int, method: str) -> Any:
        """The merged reply of a complete policy (forgotten here)."""
        parts = self.got.pop(index)
        return merge_replies(method, [parts[w] for w in self.layout.members[index]])
