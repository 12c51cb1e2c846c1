"""What a step trains on: the rows of a learner's batch (:class:`TrainRow`), the batch with the row
kinds its strategy declared (:class:`TrainBatch`), and the denominators its loss terms are reduced
over (:class:`BatchCounts`).

The strategy steps write a :class:`TrainBatch` (:func:`mutualrl.algorithms.sharing.build_batch`);
the update (:mod:`mutualrl.algorithms.update`) reads it. Neither needs the other's module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mutualrl.algorithms.registry import BoundKind

OWN = "own"
"""The row kind of the learner's own samples (the base step's)."""


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
    token_advantages: list[float] | None = None
    """A dense, per-token advantage (one per completion token) that the policy-gradient terms add to
    ``advantage`` (a step's token-level signal, e.g. ``distill``'s peer scores); None: none."""


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
    kinds: dict[str, BoundKind] = field(default_factory=dict)
    """Every row kind the strategy's steps declare, bound to their settings (what the update reads);
    empty (a batch built by hand): the base step's, own rows only."""


@dataclass(frozen=True)
class BatchCounts:
    """The denominators of the reductions, counted over the whole batch (every rank of a policy)."""

    sequences: int
    """Rows reduced by ``policy_gradient``."""
    tokens: int
    """Their completion tokens."""
    prompts: int
    """The step's prompts."""

    def __add__(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(self.sequences + other.sequences, self.tokens + other.tokens,
                           self.prompts + other.prompts)
