"""Replay of earlier steps, read back from the exchange (no extra rollouts): the prompts on which the
learner's whole group failed while a peer published a verified success, and those it solved, with
one of its own verified successes. What ``imitate`` and ``self_imitate`` gather
(:mod:`mutualrl.algorithms.strategies.imitate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mutualrl.algorithms.context import StepSource
from mutualrl.experience import VerifiedSuccess
from mutualrl.tasks.base import Problem

VERIFIED_SUCCESS = "verified_success"
"""The record kind a replay reads."""


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
class Replay:
    """Earlier steps, newest first: the failed prompts with peer successes, the solved ones with an
    own success."""

    failures: list[PastFailure] = field(default_factory=list)
    successes: list[PastSuccess] = field(default_factory=list)


def gather_replay(source: StepSource, window: int) -> Replay:
    """The prompts of the last ``window`` steps before ``source.step`` (this worker's part of them),
    newest first, sorted into those the learner failed and a peer solved (a peer's success of an
    earlier step only), and those the learner solved."""
    step = source.step
    first = max(0, step - window)
    past = [(s, p) for s in range(step - 1, first - 1, -1) for p in source.problems(s)]
    if not past:
        return Replay()
    rows = source.query(list(dict.fromkeys(p.id for _, p in past)), kinds=[VERIFIED_SUCCESS], min_version=first)
    own: dict[tuple[str, int], VerifiedSuccess] = {}
    peer: dict[str, list[VerifiedSuccess]] = {}
    for r in rows:
        if r.source_policy == source.learner:
            own.setdefault((r.prompt_id, r.version), r)
        elif r.source_policy in source.peer_names and r.version < step:
            peer.setdefault(r.prompt_id, []).append(r)
    failures = [PastFailure(p, source.encode_prompt(p.question), peer[p.id], s) for s, p in past
                if (p.id, s) not in own and p.id in peer]
    solved = [PastSuccess(p, source.encode_prompt(p.question), own[(p.id, s)].completion, s)
              for s, p in past if (p.id, s) in own]
    return Replay(failures, solved)
