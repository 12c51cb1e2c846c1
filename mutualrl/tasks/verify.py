"""Answer verifiers for user data: ``exact`` (normalised text or number) and ``math`` (math-verify).

A verifier reads a gold answer once (:meth:`Verifier.read_gold`: None when it cannot make sense of
it, so the row is counted and left out instead of scoring every completion 0) and scores an
extracted completion answer against it (:meth:`Verifier.score`, 0 or 1).

``math`` uses Hugging Face's ``math-verify`` (the verifier behind open-r1's accuracy reward):
LaTeX and plain answers, equivalent forms (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``10\\%`` = ``0.1``
where the gold says so, sets, intervals, equations ``x = 3``). A short answer without ``$`` is read
as one LaTeX expression; text that reads as prose (a word of three letters or more outside a LaTeX
command) is searched for its last mathematical expression instead.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any, Protocol

VERIFIERS: tuple[str, ...] = ("exact", "math")


class Verifier(Protocol):
    """Reads gold answers and scores completions' answers against them."""

    name: str

    def read_gold(self, answer: str) -> Any | None:
        """The gold answer in the verifier's terms, or None when it cannot be read."""
        ...

    def score(self, gold: Any, answer: str | None) -> float:
        """1.0 when ``answer`` is equivalent to ``gold`` (as :meth:`read_gold` returned it), else 0.0."""
        ...


def normalise(text: str) -> str:
    """Exact match's canonical form: numbers as floats (``1,000.`` = ``1000``), text case- and
    whitespace-folded."""
    t = text.strip().rstrip(".").replace(",", "").strip()
    try:
        f = float(t)
        if math.isfinite(f):
            return repr(float(f))
    except ValueError:
        pass
    return " ".join(t.lower().split())


class ExactVerifier:
    """Exact match after :func:`normalise`."""

    name = "exact"

    def read_gold(self, answer: str) -> str | None:
        return normalise(answer) if answer.strip() else None

    def score(self, gold: Any, answer: str | None) -> float:
        return 1.0 if answer is not None and normalise(answer) == gold else 0.0


TIMEOUT_S = 5
"""Seconds math-verify may spend parsing or comparing one answer (main thread only)."""
_PROSE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}")


class MathVerifier:
    """Mathematical equivalence through ``math-verify`` (``pip install math-verify``)."""

    name = "math"

    def __init__(self) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:
            raise ImportError("verifier: math needs the math-verify package: pip install math-verify "
                              "(or mutualrl[data])") from exc
        # it warns on every call made without a timeout (off the main thread): say it once, in the docs
        logging.getLogger("math_verify").setLevel(logging.ERROR)

    @staticmethod
    def _timeout() -> int | None:
        """math-verify's timeouts use SIGALRM, which only the main thread may set (Ray actors and
        thread pools run elsewhere: there answers are short and parsed without one)."""
        return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None

    @classmethod
    def parse(cls, text: str) -> list[Any]:
        """math-verify's reading of ``text`` (empty when it finds nothing)."""
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

        text = text.strip()
        if not text:
            return []
        timeout = cls._timeout()
        if "$" not in text and "\\boxed" not in text and not _PROSE.search(text):
            found = parse(f"${text}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
            if found:
                return found
        return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                     parsing_timeout=timeout)

    def read_gold(self, answer: str) -> list[Any] | None:
        return self.parse(answer) or None

    def score(self, gold: Any, answer: str | None) -> float:
        from math_verify import verify

        if answer is None:
            return 0.0
        found = self.parse(answer)
        if not found:
            return 0.0
        try:
            return 1.0 if verify(gold, found, timeout_seconds=self._timeout()) else 0.0
        except Exception:  # noqa: BLE001 - sympy can fail on odd input: not equivalent
            return 0.0


def make_verifier(name: str) -> Verifier:
    """The verifier called ``name`` (one of :data:`VERIFIERS`)."""
    if name == "exact":
        return ExactVerifier()
    if name == "math":
        return MathVerifier()
    raise ValueError(f"verifier must be one of {', '.join(VERIFIERS)}, got {name!r}")
