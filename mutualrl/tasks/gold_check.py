"""Gold answers no completion could be rewarded for, found before a run trains on them.

A data source can read every gold answer and still be useless: a GSM8K row whose ``answer`` is
``"Adding gives 57.\\n#### 57"``, taken whole by the default ``answer_extractor: raw``, is a gold
answer the verifier reads as text, and no completion ever writes exactly that, so the run trains at
0 % without a word. Two checks look at a sample of each file's or dataset's rows
(:data:`~mutualrl.tasks.rows.GOLD_SAMPLE`, as the source read them):

* **A known format the extractor ignores** (:data:`KNOWN_FORMATS`): the gold answer cut out by the
  configured ``answer_extractor`` still carries GSM8K's ``#### N``, a ``\\boxed{...}`` or "The answer
  is N", i.e. it is the explanation around the answer, not the answer, and the source's verifier
  does not read it as the answer the format holds (``exact`` never does; ``math`` is asked, since
  math-verify takes a text's last expression). The fix is the extractor that format needs.
* **Answers the completions' extraction cannot yield** (:func:`unmatchable_reason`): under
  ``task.answer_extraction: first_line`` a completion's answer is one line, so a multi-line gold is
  never matched by ``exact``; under ``last_number``/``first_number`` it is a number, so a gold that
  is not one (``exact``) or holds no digit at all (``math``) is never matched.

Either finding refuses the run (:class:`~mutualrl.errors.ConfigError` naming
``task.datasets[i].answer_extractor`` and the value to use, or ``task.answer_extraction`` when
numbers are extracted from completions and the golds are not numbers; exit 2) when it holds for more than
:data:`REFUSE_SHARE` of the sampled rows: the run's accuracy ceiling would be under half, which is
a configuration mistake, not data. Fewer such rows only warn (:class:`GoldAnswerWarning`), naming
the same field: a dataset may mix formats, and the rows that are fine still train.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mutualrl.errors import ConfigError
from mutualrl.tasks.base import SUCCESS_THRESHOLD, extract_answer
from mutualrl.tasks.verify import normalise

REFUSE_SHARE = 0.5
"""Above this share of the sampled rows a finding refuses the run; at or below it, it warns."""
VERIFY_AT_MOST = 200
"""Rows a ``math`` verifier is asked about per format (math-verify takes milliseconds a row)."""
_EXAMPLES = 2


class GoldAnswerWarning(UserWarning):
    """Some gold answers of a data source can never be matched (the message names the field and fix)."""


@dataclass(frozen=True)
class GoldFormat:
    """A way datasets commonly write the answer inside a longer gold text."""

    title: str
    """How the message names it."""
    pattern: re.Pattern[str]
    """Finds the format's marker in a gold text."""
    extractor: str
    """The ``answer_extractor`` that cuts the answer out of it."""


ANSWER_IS_EXTRACTOR = r"regex:(?i)the (?:final )?answer is\D*?(-?\d[\d,]*(?:\.\d+)?)"
"""The ``answer_extractor`` for golds that say "The answer is N": the number after the phrase."""

KNOWN_FORMATS: tuple[GoldFormat, ...] = (
    GoldFormat("GSM8K's '#### N'", re.compile(r"####\s*\S"), "####"),
    GoldFormat("a LaTeX '\\boxed{...}'", re.compile(r"\\boxed\s*\{"), "boxed"),
    GoldFormat("'The answer is N'", re.compile(r"(?i)\bthe (?:final )?answer is\W{0,4}-?\d"), ANSWER_IS_EXTRACTOR),
)


def known_format_of(texts: Sequence[str]) -> GoldFormat | None:
    """The known format most of ``texts`` are written in (more than :data:`REFUSE_SHARE` of them),
    or None."""
    if not texts:
        return None
    for fmt in KNOWN_FORMATS:
        if sum(bool(fmt.pattern.search(t)) for t in texts) > REFUSE_SHARE * len(texts):
            return fmt
    return None


def unmatchable_reason(gold: str, answer_extraction: str, verifier: str) -> str | None:
    """Why no completion's answer, as ``answer_extraction`` cuts it out, can equal ``gold`` under
    ``verifier``; None when one can (or when this cannot be told, e.g. a ``regex:`` extraction)."""
    text = gold.strip()
    if answer_extraction == "first_line":  # math-verify may read a multi-line gold's last expression
        return "spans several lines" if verifier == "exact" and "\n" in text else None
    if answer_extraction in ("last_number", "first_number"):
        if verifier == "exact":
            try:
                float(normalise(text))
            except ValueError:
                return "is not a number"
            return None
        return None if re.search(r"\d", text) else "holds no number"
    return None


def _examples(texts: Sequence[str]) -> str:
    distinct = list(dict.fromkeys(texts))[:_EXAMPLES]
    return ", ".join(repr(t[:50] + ("…" if len(t) > 50 else "")) for t in distinct)


def _finding(field: str, message: str, share: float) -> None:
    if share > REFUSE_SHARE:
        raise ConfigError(field, message)
    warnings.warn(f"{field}: {message}", GoldAnswerWarning, stacklevel=3)


def _format_left_in(source: Any, golds: Sequence[tuple[str, str]], fmt: GoldFormat) -> tuple[float, list[str]]:
    """(share of ``golds`` that still hold ``fmt`` and that the source's verifier does not read as the
    answer the format holds, examples of them). ``exact`` never does (the marker is part of the text);
    ``math`` may (math-verify finds the last expression of a text), so it is asked, on at most
    :data:`VERIFY_AT_MOST` of them."""
    left_in = [(raw, gold) for raw, gold in golds if fmt.pattern.search(gold)]
    if not left_in:
        return 0.0, []
    verifier = getattr(source, "verifier", None)
    if verifier is None or getattr(verifier, "name", "exact") == "exact":
        return len(left_in) / len(golds), [raw for raw, _ in left_in]
    checked = left_in[:VERIFY_AT_MOST]
    bad = []
    for raw, gold in checked:
        read = verifier.read_gold(gold)
        answer = extract_answer(raw, fmt.extractor)
        if read is None or answer is None or verifier.score(read, answer) < SUCCESS_THRESHOLD:
            bad.append(raw)
    return len(left_in) / len(golds) * len(bad) / len(checked), bad


def check_gold_answers(source: Any, task: Any, index: int) -> None:
    """Refuse or warn (see the module docstring) for ``source``, the source of ``task.datasets[index]``
    of the task config ``task``. Sources without gold texts (reasoning-gym) are not checked."""
    pairs: list[tuple[str, str | None]] = list(getattr(source, "gold_texts", None) or [])
    golds = [(raw, gold) for raw, gold in pairs if gold is not None and gold.strip()]
    if not golds:
        return
    entry = task.datasets[index]
    field = f"task.datasets[{index}].answer_extractor"
    n = len(golds)
    for fmt in KNOWN_FORMATS:
        share, examples = _format_left_in(source, golds, fmt)
        if examples:
            _finding(field, f"{round(share * n)} of {n} gold answers still hold {fmt.title} after answer_extractor "
                     f"{entry.answer_extractor!r} (e.g. {_examples(examples)}): the gold is the whole explanation "
                     f"and no completion will match it; use answer_extractor: {fmt.extractor!r}", share)
            return
    verifier = getattr(getattr(source, "verifier", None), "name", entry.verifier)
    bad: dict[str, list[str]] = {}
    for _raw, gold in golds:
        why = unmatchable_reason(gold, task.answer_extraction, verifier)
        if why is not None:
            bad.setdefault(why, []).append(gold)
    if not bad:
        return
    count = sum(len(v) for v in bad.values())
    why, texts = max(bad.items(), key=lambda kv: len(kv[1]))
    what = (f"{count} of {n} gold answers can never be matched: task.answer_extraction {task.answer_extraction!r} "
            f"cannot yield them (e.g. {_examples(texts)}: each {why})")
    if task.answer_extraction in ("last_number", "first_number"):
        # completions' answers are numbers and these golds are not: the completions' side is at fault
        _finding("task.answer_extraction", f"{what}; use task.answer_extraction: 'first_line' (or 'raw'), or "
                 "an answer_extractor that cuts a number out of the gold texts", count / n)
    elif _mostly_end_in_numbers([g for _, g in golds]):
        _finding(field, f"{what}; use answer_extractor: 'last_number' (the gold texts end in a number)", count / n)
    else:
        _finding(field, f"{what}; use an answer_extractor that cuts the answer out of the gold text ('####', "
                 "'boxed', 'last_number', 'regex:<pattern>'), or task.answer_extraction: 'raw'", count / n)


def _mostly_end_in_numbers(golds: Sequence[str]) -> bool:
    tail = re.compile(r"-?\d[\d,]*(?:\.\d+)?\W*$")
    return sum(bool(tail.search(g.strip())) for g in golds) > REFUSE_SHARE * len(golds)
