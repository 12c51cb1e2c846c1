"""``imitate``: success imitation with peers: a supervised step on a mixture of the peers' verified
successes where the learner failed and its own where it succeeded; ``self_imitate``, its control
without peers.

SGT's rescue rows are peer successes alone: a supervised step on them alone pulls the learner
towards the skill it lacks and away from the one it has (on the zoo the partner lost 5-14 points of
its own skill). ``imitate`` keeps SGT's gate and re-verification for the peer rows (prompts whose
whole own group failed; the learner's own verifier accepts the peer's answer again; text the
learner cannot write is refused) and adds, for every prompt the learner solved, its own best
completion (self-imitation learning, Oh et al. 2018): the step then sees both skills in the
proportion the learner meets them, like the warm start's mixture, and the own skill is rehearsed
instead of overwritten. With ``replay_steps`` it also replays peer successes for prompts the
learner failed in the last steps (read back from the exchange: no extra rollouts). Rows are
weighted by ``weight`` (peer rows by ``peer_weight`` when set) and trained in an optimizer step of
their own at ``learning_rate`` when one is set; the peer rows are capped at ``max_rows``, the own
rows are one per solved prompt.

``self_imitate`` is the same step without a peer: its own-success rows alone, and with
``extra_rows`` up to that many more of the learner's own verified successes of earlier steps
(newest first, read back from the exchange), so that it can train as many rows as ``imitate``
does: the compute-matched single-model control (same optimizer steps, same tokens).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from mutualrl.algorithms.context import StepSource
from mutualrl.algorithms.registry import OWN_GROUPS, RowKind
from mutualrl.algorithms.replay import Replay, gather_replay
from mutualrl.algorithms.sharing import (
    ShareContext,
    TrainBatch,
    TrainRow,
    own_rows_by_prompt,
    own_success_row,
    register_strategy,
    trained_tokens,
    trains,
    verified_successes,
)
from mutualrl.config.schema import bounded
from mutualrl.errors import ConfigError

MAX_SCHEDULE = 1_000_000
"""``match_schedule`` entries, at most (one per step)."""
IMITATE = "imitate"
"""The row kind of imitate's likelihood rows (peer successes and the learner's own)."""
SELF_IMITATE = "self_imitate"
"""The row kind of self_imitate's likelihood rows (the learner's own successes)."""


@dataclass
class ImitateSettings:
    """``sharing.imitate``: success imitation with peers."""

    weight: float = bounded(0.1, ge=0)
    """Weight of each row's length-normalised likelihood term."""
    peer_weight: float | None = bounded(None, ge=0)
    """Weight of the peers' rows (none: ``weight``)."""
    max_rows: int = bounded(16, ge=0)
    """Peer rows per step, at most (the own rows are one per solved prompt)."""
    learning_rate: float | None = bounded(None, gt=0)
    """The rows' own AdamW step at this learning rate, after the GRPO step; none: they join it."""
    replay_steps: int = bounded(0, ge=0)
    """Also replay peers' verified successes for prompts the learner failed in the last this many
    steps (the exchange keeps them; no extra rollouts)."""
    own_extra_rows: int = bounded(0, ge=0)
    """Up to this many of the learner's own verified successes of the last ``replay_steps`` steps
    besides (newest first), as ``self_imitate``'s ``extra_rows``: the sharing arm then has every row
    its compute-matched control has, with the peers' rows in place of some of them."""
    match_tokens: int = bounded(0, ge=0)
    """A token budget for the step (its GRPO rows and likelihood rows together; 0: none): the peers'
    rows are added only until the step trains this many tokens, then ``own_extra_rows`` fill what is
    left, so the arm trains what its compute-matched control does, with peers' rows first."""

    def __post_init__(self) -> None:
        _needs_replay(self.own_extra_rows, self.replay_steps, "sharing.imitate.own_extra_rows")


@dataclass
class SelfImitateSettings:
    """``sharing.self_imitate``: self-imitation, the control of ``imitate`` without peers."""

    weight: float = bounded(0.1, ge=0)
    """Weight of each row's length-normalised likelihood term."""
    learning_rate: float | None = bounded(None, gt=0)
    """The rows' own AdamW step at this learning rate, after the GRPO step; none: they join it."""
    extra_rows: int = bounded(0, ge=0)
    """Up to this many more own verified successes per step, of prompts of the last
    ``replay_steps`` steps (newest first)."""
    match_tokens: int = bounded(0, ge=0)
    """With ``extra_rows``: add them only until the step trains this many tokens (its GRPO rows and
    likelihood rows together): the compute-matched control of a sharing arm that trains that many
    tokens a step (0: every extra row)."""
    match_ceiling: bool = False
    """With ``match_tokens`` (run-wide or, as a study sets it, per policy; without one it does nothing):
    the budget is a ceiling too. A step whose GRPO rows and own-success rows
    already train more leaves out whole groups of its GRPO rows (in an order fixed by the prompts'
    ids: the same prompts go first whenever they recur) until it is within the budget; the own-success
    rows are kept, and replay may pass the budget by less than one row. A control that samples more
    to spend a sharing arm's scoring FLOPs has more informative groups, and would otherwise train more."""
    replay_steps: int = bounded(0, ge=0)
    """How many earlier steps ``extra_rows`` may come from."""
    match_schedule: list[int] = field(default_factory=list)
    """Per step, the tokens that step may train (entry ``t`` for step ``t``; past its end,
    ``match_tokens``): the matched arm's own trained tokens step by step (a study sets it per policy),
    so the control trains on the steps that arm trained on, and about as much. An entry of 0 trains
    nothing that step (no row at all: no optimizer step); any other is that step's budget as
    ``match_tokens`` is (a ceiling too with ``match_ceiling``)."""

    def __post_init__(self) -> None:
        _needs_replay(self.extra_rows, self.replay_steps, "sharing.self_imitate.extra_rows")
        bad = next((i for i, v in enumerate(self.match_schedule)
                    if isinstance(v, bool) or not isinstance(v, int) or v < 0), None)
        if bad is not None:
            raise ConfigError(f"sharing.self_imitate.match_schedule[{bad}]",
                              f"{self.match_schedule[bad]!r}: each entry is a step's token budget, an integer >= 0 "
                              "(0: the step trains nothing)")
        if len(self.match_schedule) > MAX_SCHEDULE:
            raise ConfigError("sharing.self_imitate.match_schedule",
                              f"{len(self.match_schedule)} entries: at most {MAX_SCHEDULE} (one per step)")


def _needs_replay(rows: int, replay_steps: int, field: str) -> None:
    """Earlier own successes come from the last ``replay_steps`` steps: rows without them would be a
    silent no-op."""
    if isinstance(rows, int) and rows > 0 and isinstance(replay_steps, int) and replay_steps < 1:
        head = field.rsplit(".", 1)[0]
        raise ConfigError(field, f"{rows} rows of earlier own successes need {head}.replay_steps >= 1 (the "
                          f"steps they may come from); set it, or {field.rsplit('.', 1)[1]}: 0")


def _gather_imitate(source: StepSource, s: ImitateSettings) -> Replay | None:
    """The last ``replay_steps`` steps, read back from the exchange (none without replay)."""
    return gather_replay(source, s.replay_steps) if s.replay_steps else None


@dataclass
class SelfImitateStep:
    """What ``self_imitate`` gathers before its batch: the earlier steps its extra rows come from, and
    this step's token budget (``match_schedule``'s entry; None: ``match_tokens``)."""

    replay: Replay = field(default_factory=Replay)
    budget: int | None = None


def _gather_self_imitate(source: StepSource, s: SelfImitateSettings) -> SelfImitateStep:
    """The last ``replay_steps`` steps when ``extra_rows`` asks for earlier own successes, and this step's
    entry of ``match_schedule``."""
    replay = gather_replay(source, s.replay_steps) if s.extra_rows and s.replay_steps else Replay()
    budget = s.match_schedule[source.step] if 0 <= source.step < len(s.match_schedule) else None
    return SelfImitateStep(replay, budget)


@register_strategy("imitate", settings=ImitateSettings,
                   rows={IMITATE: RowKind("likelihood", learning_rate=lambda s: s.learning_rate)},
                   reads=("verified_success",), conflicts=("sgt",), gather=_gather_imitate)
def imitate(ctx: ShareContext, batch: TrainBatch, s: ImitateSettings) -> None:
    """Success imitation: peer successes where the learner failed, its own where it succeeded."""
    replay: Replay = ctx.gathered.get("imitate") or Replay()
    tally: Counter[str] = Counter()
    own_rows = [row for g in ctx.groups if (row := own_success_row(g, s.weight, IMITATE)) is not None]
    failed = [(g.problem, g.prompt_ids, ctx.peers.successes.get(g.problem.id, [])) for g in ctx.groups if g.failed]
    candidates = failed + [(h.problem, h.prompt_ids, h.successes) for h in replay.failures]
    peer_weight = s.weight if s.peer_weight is None else s.peer_weight
    seen: set[str] = set()
    rescue = replayed = 0
    cap = ctx.rank_share(s.max_rows)
    # with a token budget the peers' rows come first within it, then own earlier successes fill it
    budget = ctx.rank_share(s.match_tokens) if s.match_tokens else 0
    tokens = trained_tokens(batch, ctx.options) + sum(len(r.completion_ids) for r in own_rows)
    for k, (problem, prompt_ids, successes) in enumerate(candidates):
        if rescue >= cap or (budget and tokens >= budget):
            break
        if problem.id in seen:
            continue
        found = next(verified_successes(ctx, problem, prompt_ids, successes, tally), None)
        if found is None:
            continue
        batch.rows.append(TrainRow(prompt_ids, found[0], 0.0, None, IMITATE, None, peer_weight))
        tokens += len(found[0])
        batch.peer_rows[found[2]] += 1
        seen.add(problem.id)
        rescue += 1
        replayed += k >= len(failed)
    batch.rows.extend(own_rows)
    if s.own_extra_rows:
        batch.metrics["imitate_own_extra"] = _own_replay(ctx, batch, replay, s.weight, IMITATE, s.own_extra_rows,
                                                         s.match_tokens, seen)
    batch.metrics["imitate_gate_open"] = len(failed)
    batch.metrics["imitate_rescue"] = rescue
    batch.metrics["imitate_own"] = len(own_rows)
    batch.metrics["imitate_replayed"] = replayed
    batch.metrics["imitate_refused"] = tally["refused"]
    batch.metrics["imitate_unrepresentable"] = tally["unrepresentable"]


@register_strategy("self_imitate", settings=SelfImitateSettings,
                   rows={SELF_IMITATE: RowKind("likelihood", learning_rate=lambda s: s.learning_rate)},
                   conflicts=("sgt", "imitate"), gather=_gather_self_imitate,
                   # match_ceiling leaves out whole groups of the base rows: it runs after every step that
                   # reads them group by group, and reads them so itself
                   needs=(OWN_GROUPS,), breaks=(OWN_GROUPS,))
def self_imitate(ctx: ShareContext, batch: TrainBatch, s: SelfImitateSettings) -> None:
    """The control of ``imitate``: its own-success rows alone, no peer row (what self-imitation gives
    without sharing); with ``extra_rows``, own successes of earlier steps besides."""
    gathered: SelfImitateStep = ctx.gathered.get("self_imitate") or SelfImitateStep()
    budget = s.match_tokens if gathered.budget is None else gathered.budget
    if gathered.budget == 0:  # the matched arm trained nothing this step: neither does its control
        batch.metrics["self_imitate_rows_left_out"] = len(batch.rows)
        batch.rows = []
        return
    rows = [row for g in ctx.groups if (row := own_success_row(g, s.weight, SELF_IMITATE)) is not None]
    batch.rows.extend(rows)
    if s.match_ceiling and budget:
        batch.metrics["self_imitate_groups_left_out"] = _within_budget(ctx, batch, budget)
    extra = _own_replay(ctx, batch, gathered.replay, s.weight, SELF_IMITATE, s.extra_rows, budget)
    batch.metrics["imitate_own"] = len(rows)
    batch.metrics["self_imitate_extra"] = extra


def _within_budget(ctx: ShareContext, batch: TrainBatch, match_tokens: int) -> int:
    """Leave out whole groups of the base step's GRPO rows, in an order fixed by the prompts' ids (a
    hash, so no random stream is drawn), until the step trains at most ``match_tokens`` tokens (this
    rank's share); how many groups were left out. Groups whose rows do not train (no reward variance
    under dynamic sampling) are passed over."""
    budget = ctx.rank_share(match_tokens)
    tokens = trained_tokens(batch, ctx.options)
    if tokens <= budget:
        return 0
    groups = own_rows_by_prompt(batch, ctx.groups)
    order = sorted(range(len(groups)), key=lambda i: hashlib.sha256(ctx.groups[i].problem.id.encode()).hexdigest())
    out: set[int] = set()
    left_out = 0
    for i in order:
        if tokens <= budget:
            break
        live = [r for r in groups[i] if trains(r, batch, ctx.options)]
        if not live:
            continue
        out |= {id(r) for r in groups[i]}
        tokens -= sum(len(r.completion_ids) for r in live)
        left_out += 1
    batch.rows = [r for r in batch.rows if id(r) not in out]
    return left_out


def _own_replay(ctx: ShareContext, batch: TrainBatch, replay: Replay, weight: float, kind: str, most: int,
                match_tokens: int, exclude: set[str] | None = None) -> int:
    """Add up to ``most`` of the learner's own verified successes of earlier steps (newest first, one
    per problem, none of this step's or of ``exclude``), until the step trains ``match_tokens`` tokens
    (0: no bound); how many were added."""
    step_ids = {g.problem.id for g in ctx.groups} | (exclude or set())
    extra = 0
    tokens = trained_tokens(batch, ctx.options)
    extra_cap, token_cap = ctx.rank_share(most), ctx.rank_share(match_tokens)
    for past in replay.successes:
        if extra >= extra_cap or (token_cap and tokens >= token_cap):
            break
        if past.problem.id in step_ids:
            continue
        ids = ctx.encode_completion(past.prompt_ids, past.completion)
        if ids is None:
            continue
        batch.rows.append(TrainRow(past.prompt_ids, ids, 0.0, None, kind, None, weight))
        step_ids.add(past.problem.id)
        extra += 1
        tokens += len(ids)
    return extra
