"""What a strategy step reads: the learner's own groups (:class:`OwnGroup`), the peers' rows in
fair order (:class:`PeerRows`), and the context of the step (:class:`ShareContext`), with what each
step's ``gather`` hook fetched through a :class:`StepSource` before the batch is built.

The worker fills a :class:`StepSource` with what any step may ask of the exchange and of the
learner (the step's prompts of earlier steps, a query, the learner's prompt encoding); a step that
needs more than the step's own groups and peer rows (a replay of earlier steps, peers' scores)
declares a ``gather`` hook (:func:`~mutualrl.algorithms.registry.register_strategy`) and reads
what it returned from ``ctx.gathered[<its name>]``. The worker names no step and no record kind a
step owns.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mutualrl.experience import GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.rollout.modeling import format_prompt
from mutualrl.tasks.base import SUCCESS_THRESHOLD, Problem
from mutualrl.thl.peer import PeerTrace

if TYPE_CHECKING:
    from mutualrl.config import GRPOOptions


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
    record_ids: list[str] = field(default_factory=list)
    """The ids of the completions' published rollout records (what a peer's score names)."""

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
class ShareContext:
    """Everything a strategy step may read (its settings come as its own argument)."""

    groups: list[OwnGroup]
    peers: PeerRows
    options: GRPOOptions
    score: ScoreFn
    """The learner's own reward and verifier: a peer's claim is never trusted."""
    encode_completion: EncodeFn
    align_peer: AlignFn | None = None
    gathered: dict[str, Any] = field(default_factory=dict)
    """What each step's ``gather`` hook fetched for this step (from the exchange, before the batch
    is built), by step name: the one per-step slot a step reads its own context from."""
    world: int = 1
    """How many data-parallel ranks share the policy's step (``policies[i].workers``): the groups
    here are this rank's part of the step's prompts."""
    sum_over_ranks: Callable[[Sequence[float]], list[float]] | None = None
    """Element-wise sum over the ranks (:meth:`~mutualrl.run.distributed.RankGroup.sum`; None: one rank)."""

    def rank_share(self, per_step: int) -> int:
        """This rank's part of a per-step cap (``max_rows``, ``match_tokens``): the cap over the
        ranks, rounded up, so the ranks together take what one worker would."""
        return per_step if self.world <= 1 else -(-per_step // self.world)


@dataclass(frozen=True)
class PeerView:
    """What a learner knows of one peer policy: enough to read its rollouts in the peer's terms."""

    name: str
    tokenizer: Any
    tokenizer_id: str
    stop_ids: frozenset[int]
    prompt_template: str
    system_prompt: str | None

    def format_prompt(self, question: str) -> str:
        """The peer's prompt text for ``question``."""
        return format_prompt(self.prompt_template, self.system_prompt, self.tokenizer, question)


ScoreTextsFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[list[float]]]
"""(prompt ids, completion ids) -> the policy's per-token log-probs of each completion (no gradient)."""


@dataclass(frozen=True)
class StepSource:
    """What a step's ``gather`` (before its batch) and ``serve`` (for its peers, between the
    rollouts and the updates) hooks may ask for at step ``step``; the worker fills it in."""

    step: int
    learner: str
    """This policy's name (its own records carry it as ``source_policy``)."""
    peer_names: frozenset[str]
    """The run's other policies: rows under any other name are not a peer's."""
    problems: Callable[[int], list[Problem]]
    """This worker's prompts of a step (the same for every policy; this rank's part of them)."""
    query: Callable[..., list[Any]]
    """The exchange's query: ``query(prompt_ids, kinds=[...], min_version=..., exclude_source=...)``."""
    encode_prompt: Callable[[str], list[int]]
    """This policy's prompt ids of a question (its template and system prompt)."""
    peers: Mapping[str, PeerView] = field(default_factory=dict)
    """The other policies' tokenizers and prompt formats, by name."""
    me: PeerView | None = None
    """This policy as its peers see it (its tokenizer, stop ids, prompt format)."""
    score_texts: ScoreTextsFn | None = None
    """One forward of this policy's model over completions (a scoring phase)."""
    parameters: int = 0
    """This policy's parameter count (the FLOPs a forward token costs: twice that)."""
    task_types: tuple[str, ...] = ()
    """The task's problem types (``Problem.source``), the same on every rank."""
    memo: dict[str, Any] = field(default_factory=dict)
    """A place a step may keep derived values across steps (a cache: never needed for correctness, a
    resumed run starts it empty); the worker keeps it for its lifetime."""
