"""A task source made of rows (question + gold answer): what user files and datasets have in common.

Columns are named by the config or found (``question``/``prompt``/``problem``; ``answer``/
``solution``); a conversational prompt (a list of ``{"role", "content"}`` messages, TRL's
``prompt`` or a ``messages`` column) contributes its last user turn, which each policy formats
with its own template (``prompt_template: chat``: its tokenizer's chat template). The gold answer
is cut out of the answer column by ``answer_extractor`` (``####`` for GSM8K, ``boxed``, a
``regex:``), then read once by the source's verifier (``exact`` or ``math``): rows whose gold
cannot be read are left out and counted, and a source where more than
:data:`MAX_UNREADABLE_GOLD` of them cannot be read is refused (a wrong column or extractor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from mutualrl.tasks.base import Problem, extract_answer, problem_id
from mutualrl.tasks.gold_check import known_format_of
from mutualrl.tasks.verify import Verifier, make_verifier

QUESTION_COLUMNS = ("question", "prompt", "problem", "messages")
ANSWER_COLUMNS = ("answer", "solution")
MAX_UNREADABLE_GOLD = 0.10
"""The largest share of rows whose gold answer the verifier may fail to read before the source is refused."""
GOLD_SAMPLE = 2000
"""Rows whose raw gold text a source keeps (:attr:`RowSource.gold_texts`) for the checks made before a run
trains (:mod:`mutualrl.tasks.gold_check`)."""


class SourceFieldError(ValueError):
    """A problem with one field of a data source's config (``field``: e.g. ``answer_field``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def find_column(columns: Sequence[str], given: str | None, candidates: Sequence[str], field: str) -> str:
    """The column to read: ``given`` when it exists, else the first of ``candidates`` that does."""
    if given is not None:
        if given not in columns:
            raise SourceFieldError(field, f"column {given!r} is not in the data (columns: {', '.join(columns)})")
        return given
    for c in candidates:
        if c in columns:
            return c
    raise SourceFieldError(field, f"none of the columns {', '.join(candidates)} is in the data (columns: "
                           f"{', '.join(columns)}); name it with {field}")


def question_text(value: Any) -> str:
    """The question of a cell: the text, or the last user turn of a conversation."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        users = [m for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1].get("content"), str):
            return users[-1]["content"]
    raise ValueError("a question must be text or a list of chat messages with a user turn")


def _order_key(question: str) -> bytes:
    """Where a row sits in its split: a hash of its question, independent of the file's order."""
    return hashlib.sha1(f"order:{question}".encode()).digest()


class RowSource:
    """Problems from rows with a question and a gold answer, split into train and test.

    ``test_rows``: the test split's rows (the dataset's own test split); when None, a
    deterministic ``test_fraction`` of the rows, chosen by a hash of the question, is held out.
    Each split is kept in an order set by another hash of the question, not the file's: files are
    often sorted (by operand, length, source), and the first ``n`` rows of a sorted file, or its last
    ones, are no sample of it.
    """

    def __init__(self, name: str, rows: Sequence[Mapping[str, Any]], *, question_field: str | None = None,
                 answer_field: str | None = None, answer_extractor: str = "raw", verifier: str = "exact",
                 test_fraction: float = 0.2, test_rows: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.name = name
        self.verifier: Verifier = make_verifier(verifier)
        if not rows:
            raise SourceFieldError("split", "the data has no rows")
        columns = list(rows[0].keys())
        self.question_field = find_column(columns, question_field, QUESTION_COLUMNS, "question_field")
        self.answer_field = find_column(columns, answer_field, ANSWER_COLUMNS, "answer_field")
        self.answer_extractor = answer_extractor
        self.test_fraction = test_fraction
        self.unreadable_gold = 0
        self._bad_example = ""  # the first gold answer the verifier could not read, for the message
        self.gold_texts: list[tuple[str, str | None]] = []
        """(raw text of ``answer_field``, the gold ``answer_extractor`` cut out of it or None) of the
        first :data:`GOLD_SAMPLE` rows, readable or not."""
        self._problems: dict[str, list[Problem]] = {"train": [], "test": []}
        if test_rows is not None:
            self._add(rows, "train")
            self._add(test_rows, "test")
        else:
            self._add(rows, None)
        total = len(rows) + len(test_rows or ())
        if self.unreadable_gold > MAX_UNREADABLE_GOLD * total:
            what = f"the {verifier} verifier cannot read {self.unreadable_gold} of {total} gold answers of column " \
                   f"{self.answer_field!r} (extractor {answer_extractor!r}, e.g. {self._bad_example!r})"
            fmt = known_format_of([raw for raw, _ in self.gold_texts])
            if fmt is not None and fmt.extractor != answer_extractor:
                raise SourceFieldError("answer_extractor", f"{what}; they look like {fmt.title}: use "
                                       f"answer_extractor: {fmt.extractor!r}")
            raise SourceFieldError("answer_field", f"{what}; check answer_field and answer_extractor")
        if not self._problems["train"]:
            raise SourceFieldError("split", f"no usable training rows (of {total})")
        for probs in self._problems.values():
            probs.sort(key=lambda p: _order_key(p.question))
        if test_rows is not None and not self._problems["test"]:
            raise SourceFieldError("test_split", f"no usable test rows (of {len(test_rows)})")

    def _add(self, rows: Sequence[Mapping[str, Any]], split: str | None) -> None:
        seen = {p.question for probs in self._problems.values() for p in probs}
        for i, row in enumerate(rows, 1):
            if self.question_field not in row or self.answer_field not in row:
                raise SourceFieldError("question_field", f"row {i} lacks the columns "
                                       f"{self.question_field!r}/{self.answer_field!r}")
            try:
                q = question_text(row[self.question_field])
            except ValueError as exc:
                raise SourceFieldError("question_field", f"row {i}: {exc}") from None
            raw = str(row[self.answer_field])
            answer = extract_answer(raw, self.answer_extractor)
            if len(self.gold_texts) < GOLD_SAMPLE:
                self.gold_texts.append((raw, answer))
            gold = self.verifier.read_gold(answer) if answer is not None else None
            if gold is None:
                self.unreadable_gold += 1
                self._bad_example = self._bad_example or raw[:60]
                continue
            if q in seen:
                continue
            seen.add(q)
            where = split or ("test" if self._held_out(q) else "train")
            self._problems[where].append(Problem(problem_id(self.name, q), q, answer, self.name,
                                                 {"answer": answer, "gold": gold}))

    def _held_out(self, question: str) -> bool:
        h = hashlib.sha1(f"0:{question}".encode()).digest()  # the split never depends on a run's seed
        return int.from_bytes(h[:4], "big") / 2**32 < self.test_fraction

    def generate(self, split: str, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` problems of ``split``: a sample of it whatever the file's order (rows are kept in the
        order of a hash of the question), the same for every ``seed``."""
        return self._problems["test" if split == "test" else "train"][:n]

    def score(self, problem: Problem, answer: str | None) -> float:
        gold = problem.entry.get("gold")
        if gold is None:
            gold = self.verifier.read_gold(problem.answer)
        return self.verifier.score(gold, answer) if gold is not None else 0.0

    def data_report(self) -> dict[str, int]:
        """What reading the rows found: problems per split, gold answers the verifier could not read."""
        return {f"{self.name}/train_rows": len(self._problems["train"]),
                f"{self.name}/test_rows": len(self._problems["test"]),
                f"{self.name}/gold_unreadable": self.unreadable_gold}
