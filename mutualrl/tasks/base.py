"""Problems, task sources and the mixture task that samples from them.

A *source* yields problems of one type (one reasoning-gym dataset with one config, or one user
file). A :class:`Task` is a weighted mixture of sources with disjoint train/test splits, one
verifier per source, and optional extra reward functions.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mutualrl.tasks.rewards import call_reward_function

SPLITS: tuple[str, ...] = ("train", "val", "test")
"""A task's splits, disjoint by question: training prompts, validation (choices) and test (reported)."""

SUCCESS_THRESHOLD = 0.999
"""A completion counts as a *success* (accuracy, SGT) when its verifier score reaches this."""

REWARD_MODES: tuple[str, ...] = ("score", "exact")
"""How a verifier score becomes the reward: ``score`` passes it through (reasoning-gym gives
partial credit, e.g. 0.67 for ``570`` when the answer is ``57``), ``exact`` gives 1 for a success
(score >= :data:`SUCCESS_THRESHOLD`) and 0 otherwise."""


@dataclass(frozen=True)
class Problem:
    """One verifiable question.

    ``id`` is stable across processes and policies (it is the key experience is shared under):
    ``<source>/<12 hex chars of sha1(question)>``.
    """

    id: str
    question: str
    answer: str
    source: str
    entry: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def problem_id(source: str, question: str) -> str:
    """The stable id of ``question`` in ``source``."""
    return f"{source}/{hashlib.sha1(question.encode('utf-8')).hexdigest()[:12]}"


class Source(Protocol):
    """A stream of problems of one type with its own verifier."""

    name: str

    def generate(self, split: str, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` distinct problems for ``split`` ('train' or 'test'), deterministic in seed."""
        ...

    def score(self, problem: Problem, answer: str | None) -> float:
        """Verifier score in [0, 1] of an extracted answer."""
        ...


# ----------------------------------------------------------------------------- answer extraction
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXTRACTION_MODES: tuple[str, ...] = ("first_line", "last_number", "first_number", "boxed", "####", "raw")
"""Answer extraction modes besides ``regex:<pattern>``."""


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, braces nested to any depth
    (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); None when there is none or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def extract_answer(text: str, mode: str = "first_line") -> str | None:
    """Pull the answer out of a completion.

    Modes: ``first_line`` (strip, first non-empty line), ``last_number`` / ``first_number`` (the
    last / first integer or decimal; a base model's first number is its answer, what follows is it
    continuing the text), ``boxed`` (content of the last ``\\boxed{...}``, nested braces included),
    ``####`` (what follows the last ``####``, GSM8K's form), ``regex:<pattern>`` (group 1, or the
    whole match), ``raw`` (the stripped text).
    """
    if mode == "raw":
        return text.strip()
    if mode == "first_line":
        for line in text.strip().splitlines():
            if line.strip():
                return line.strip()
        return ""
    if mode in ("last_number", "first_number"):
        nums = _NUMBER.findall(text.replace(",", ""))
        return (nums[-1] if mode == "last_number" else nums[0]) if nums else None
    if mode == "boxed":
        return last_boxed(text)
    if mode == "####":  # GSM8K's reference answers end with '#### <answer>'
        _, sep, tail = text.rpartition("####")
        return tail.strip().replace(",", "") if sep else None
    if mode.startswith("regex:"):
        m = None
        for m in re.finditer(mode[len("regex:"):], text):
            pass
        if m is None:
            return None
        return (m.group(1) if m.groups() else m.group(0)).strip()
    raise ValueError(f"unknown answer extraction mode {mode!r}")


def validate_extraction_mode(mode: str) -> str | None:
    """Return an error message if ``mode`` is not a valid extraction mode, else None."""
    if mode in EXTRACTION_MODES:
        return None
    if mode.startswith("regex:"):
        try:
            re.compile(mode[len("regex:"):])
        except re.error as exc:
            return f"invalid regular expression: {exc}"
        return None
    return f"expected one of {', '.join(EXTRACTION_MODES)}, regex:<pattern>"


# ----------------------------------------------------------------------------- the mixture task
@dataclass
class RewardStats:
    """Counters of reward-function failures (each failed completion got reward 0)."""

    raised: int = 0
    non_finite: int = 0
    timed_out: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"reward_fn_raised": self.raised, "reward_fn_non_finite": self.non_finite,
                "reward_fn_timed_out": self.timed_out}


FRESH_DRAWS = 6
"""Draws :func:`fresh_problems` makes, each four times the one before, before it gives up."""


def fresh_problems(src: Source, n: int, seed: int, seen: set[str]) -> list[Problem]:
    """``n`` distinct problems of ``src`` whose question is not in ``seen``, deterministic in ``seed``:
    generated in draws of growing size until enough lie outside ``seen`` (or a draw comes back short of
    distinct problems: the space is used up). Raises ``ValueError`` naming
    the source and how many it found when its problem space has too few left."""
    want = max(4 * n, 64)
    found: list[Problem] = []
    for _ in range(FRESH_DRAWS):
        drawn = src.generate("test", want, seed)
        found = [p for p in drawn if p.question not in seen]
        if len(found) >= n:
            return found[:n]
        if len(drawn) < want:  # the draw held every distinct problem there is: a larger one finds no more
            break
        want *= 4
    raise ValueError(f"source {src.name!r} has {len(found)} problems outside the earlier splits, {n} asked "
                     "for the fresh held-out split; use a smaller test_size / val_size, or a larger problem space")


class Task:
    """A weighted mixture of sources with disjoint train, validation and test splits.

    The test split of every source is generated first; training problems equal to a test
    question are removed, so the splits are disjoint by question text. With ``val_size`` the last
    problems of each source's training list are held out as its validation split (the rule the
    zoo's warm starts use for theirs: a build and a run on its task agree on what is validation).
    The splits depend on ``seed`` only; the order training prompts are drawn in depends on
    ``prompt_seed`` (default ``seed``), so runs of different seeds can see different prompt streams
    on the same splits.

    ``heldout_seed`` draws *fresh* held-out problems instead: per source, problems that none of the
    ``seed`` splits holds (its test, training and validation lists, so nothing a run or a warm start
    on those splits trained, chose or was tested on), generated with this seed. They become the test
    split; with ``val_like_test`` the validation split too, the pool cut at random into the two, so
    validation is distributed like test, source by source (the tail of the training list can lack
    what the test draw used up of a small problem space). Training keeps the ``seed`` training list
    (minus the validation tail when validation stays there).
    """

    reward_range: tuple[float, float] = (0.0, 1.0)

    def __init__(
        self,
        sources: Sequence[Source],
        weights: Sequence[float],
        *,
        test_size: int = 1000,
        train_size: int = 20000,
        seed: int = 0,
        answer_extraction: str = "first_line",
        reward_functions: Sequence[Any] = (),
        reward_timeout_s: float = 10.0,
        reward: str = "score",
        val_size: int = 0,
        prompt_seed: int | None = None,
        heldout_seed: int | None = None,
        val_like_test: bool = False,
    ) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("need one weight per source and at least one source")
        self.sources = list(sources)
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.seed = seed
        self.prompt_seed = seed if prompt_seed is None else prompt_seed
        self.answer_extraction = answer_extraction
        self.reward_functions = list(reward_functions)
        self.reward_timeout_s = reward_timeout_s
        if reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {', '.join(REWARD_MODES)}, got {reward!r}")
        self.reward_mode = reward
        self.reward_stats = RewardStats()
        self.test: dict[str, list[Problem]] = {}
        self.val: dict[str, list[Problem]] = {}
        self.train: dict[str, list[Problem]] = {}
        self._by_id: dict[str, Problem] = {}
        for i, src in enumerate(self.sources):
            n_test = max(1, round(test_size * self.weights[i]))
            n_train = max(1, round(train_size * self.weights[i]))
            n_val = round(val_size * self.weights[i]) if val_size else 0
            test, val, train = self._splits(i, n_test, n_train, n_val, heldout_seed, val_like_test)
            self.test[src.name] = test
            self.val[src.name] = val
            self.train[src.name] = train
            for p in test + val + train:
                self._by_id[p.id] = p

    def _splits(self, i: int, n_test: int, n_train: int, n_val: int, heldout_seed: int | None,
                val_like_test: bool) -> tuple[list[Problem], list[Problem], list[Problem]]:
        """(test, validation, train) of source ``i``: test and train drawn with the task's seed (train
        without the test questions), validation the last ``n_val`` of train; with ``heldout_seed``
        the test (and with ``val_like_test`` the validation) cut from fresh problems instead."""
        src, seed = self.sources[i], self.seed
        test = src.generate("test", n_test, self.split_seed(seed, i, "test"))
        test_q = {p.question for p in test}
        train = [p for p in src.generate("train", n_train, self.split_seed(seed, i, "train"))
                 if p.question not in test_q]
        if heldout_seed is not None:
            pool = fresh_problems(src, n_test + (n_val if val_like_test else 0),
                                  self.split_seed(heldout_seed, i, "test"), test_q | {p.question for p in train})
            if val_like_test:
                random.Random(f"{heldout_seed}:{i}:cut").shuffle(pool)
                return pool[:n_test], pool[n_test:], train
            test = pool
        elif len(train) - n_val < 1:
            raise ValueError(f"source {src.name!r} has no training problems left after removing "
                             f"the test{' and validation' if n_val else ''} questions; use a larger problem "
                             "space or a smaller test_size" + (" / val_size" if n_val else ""))
        val = train[len(train) - n_val:] if n_val else []
        return test, val, train[:len(train) - n_val]

    # -- problems
    def heldout_check(self, earlier: Sequence[Task]) -> dict[str, int]:
        """How many of this task's validation and test questions each of the ``earlier`` tasks (other
        split seeds of the same sources) holds in any of its splits, by ``<split>/<earlier seed>``
        (zeros: disjoint)."""
        mine = {s: {p.question for ps in self.split(s).values() for p in ps} for s in ("val", "test")}
        out: dict[str, int] = {}
        for other in earlier:
            theirs = {p.question for s in SPLITS for ps in other.split(s).values() for p in ps}
            for s, qs in mine.items():
                out[f"{s}/{other.seed}"] = len(qs & theirs)
        return out

    @staticmethod
    def split_seed(seed: int, position: int, split: str) -> int:
        """The generation seed of the ``split`` ("test" or "train"; validation is the tail of train)
        of the source at ``position`` in a task of seed ``seed``: a source's problems depend on its
        place in the task's list, so one type held out of a study must be held out at every place."""
        return seed * 1000 + 2 * position + (1 if split == "test" else 2)

    @property
    def source_names(self) -> list[str]:
        """The names (aliases) of the task's sources, in the config's order: its skills."""
        return [s.name for s in self.sources]

    def split(self, name: str) -> dict[str, list[Problem]]:
        """The problems of split ``name`` (``train``, ``val`` or ``test``) per source."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {name!r}")
        return {"train": self.train, "val": self.val, "test": self.test}[name]

    @property
    def has_validation(self) -> bool:
        """Whether the task holds a validation split out of training (``val_size`` > 0)."""
        return any(self.val.values())

    def problems(self, split: str = "test", n: int | None = None) -> list[Problem]:
        """All problems of ``split`` (sources in order), the first ``n`` if given."""
        pools = self.split(split)
        out = [p for name in self.source_names for p in pools[name]]
        return out if n is None else out[:n]

    def sample_train(self, step: int, n: int, round: int = 0,
                     exclude: frozenset[str] = frozenset()) -> list[Problem]:
        """The training batch for ``step``: deterministic in (prompt_seed, step), so resume needs no state.

        ``round`` > 0 draws a further batch for the same step (dynamic sampling), leaving out the
        problem ids in ``exclude`` (those drawn earlier in the step). Round 0 is the same for every
        policy of a run, so their groups share prompt ids.
        """
        seed = self.prompt_seed
        rng = random.Random(f"{seed}:{step}" if round == 0 else f"{seed}:{step}:r{round}")
        names = rng.choices(self.source_names, weights=self.weights, k=n)
        # without replacement within a step: experience is shared keyed by prompt id, so a prompt
        # twice in one batch would mix two groups under one key (repeats only if a pool is too small)
        picks = {}
        for name in self.source_names:
            k, pool = names.count(name), self.train[name]
            if exclude:
                pool = [p for p in pool if p.id not in exclude] or pool
            chosen = rng.sample(pool, min(k, len(pool)))
            chosen += [rng.choice(pool) for _ in range(k - len(chosen))]
            picks[name] = iter(chosen)
        return [next(picks[name]) for name in names]

    def get(self, prompt_id: str) -> Problem | None:
        """The problem with this id, or None (unknown prompt ids from peers are refused)."""
        return self._by_id.get(prompt_id)

    def known_ids(self) -> set[str]:
        """Ids of every problem of the task, every split: what a peer's row may refer to."""
        return set(self._by_id)

    def data_report(self) -> dict[str, int]:
        """What reading the sources found (problems per split, gold answers a verifier could not read),
        for the sources that report it (files and datasets)."""
        out: dict[str, int] = {}
        for s in self.sources:
            report = getattr(s, "data_report", None)
            if report is not None:
                out.update(report())
        return out

    # -- rewards
    def _source(self, problem: Problem) -> Source:
        for s in self.sources:
            if s.name == problem.source:
                return s
        raise KeyError(problem.source)

    def verify(self, problem: Problem, completion: str) -> float:
        """The verifier's score of ``completion`` for ``problem`` in [0, 1]."""
        answer = extract_answer(completion, self.answer_extraction)
        score = float(self._source(problem).score(problem, answer))
        return score if math.isfinite(score) else 0.0

    def is_success(self, score: float) -> bool:
        """Whether a reward counts as a verified success (``score >= SUCCESS_THRESHOLD``)."""
        return score >= SUCCESS_THRESHOLD

    def rewards(self, problems: Sequence[Problem], prompts: Sequence[str],
                completions: Sequence[str]) -> tuple[list[float], list[float]]:
        """(rewards, verifier scores) for aligned lists.

        Reward = the verifier's score (or, with ``reward="exact"``, 1 for a success and 0 otherwise)
        plus the sum of the extra reward functions. ``prompts`` are the formatted prompts the
        policy saw; the reward functions receive them.
        """
        scores = [self.verify(p, c) for p, c in zip(problems, completions, strict=True)]
        if self.reward_mode == "exact":
            rewards = [1.0 if s >= SUCCESS_THRESHOLD else 0.0 for s in scores]
        else:
            rewards = list(scores)
        if self.reward_functions:
            columns = {"answer": [p.answer for p in problems], "question": [p.question for p in problems],
                       "source": [p.source for p in problems], "prompt_id": [p.id for p in problems]}
            for fn in self.reward_functions:
                extra = call_reward_function(fn, list(prompts), list(completions), columns,
                                             self.reward_timeout_s, self.reward_stats)
                rewards = [r + e for r, e in zip(rewards, extra, strict=True)]
        return rewards, scores
