"""User data as a task source: JSONL or Parquet files with question/answer columns."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from mutualrl.tasks.base import Problem, problem_id


def _normalise(text: str) -> str:
    t = text.strip().rstrip(".").replace(",", "").strip()
    try:
        f = float(t)
        if math.isfinite(f):
            return repr(float(f))
    except ValueError:
        pass
    return " ".join(t.lower().split())


class FileSource:
    """Problems read from a ``.jsonl`` or ``.parquet`` file.

    The test split holds the rows whose id hashes below ``test_fraction``; the rest is train.
    The verifier is exact match after normalisation (numbers compared as numbers, case and
    whitespace folded): reward 1.0 or 0.0.
    """

    def __init__(self, path: str | Path, name: str | None = None, question_field: str = "question",
                 answer_field: str = "answer", test_fraction: float = 0.2) -> None:
        self.path = Path(path)
        self.name = name or self.path.stem
        self.question_field = question_field
        self.answer_field = answer_field
        self.test_fraction = test_fraction
        self.rows = self._read()

    def _read(self) -> list[dict]:
        if not self.path.is_file():
            raise ValueError(f"data file {str(self.path)!r} does not exist")
        try:
            if self.path.suffix == ".parquet":
                import pyarrow.parquet as pq

                rows = pq.read_table(self.path).to_pylist()
            else:
                rows = []
                with self.path.open("r", encoding="utf-8") as fh:
                    for lineno, line in enumerate(fh, 1):
                        if line.strip():
                            try:
                                rows.append(json.loads(line))
                            except json.JSONDecodeError as exc:
                                raise ValueError(f"{self.path}:{lineno}: not valid JSON ({exc.msg})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read data file {str(self.path)!r}: {exc}") from None
        except ImportError:
            raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from None
        out = []
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict) or self.question_field not in row or self.answer_field not in row:
                raise ValueError(f"{self.path}: row {i} lacks the columns "
                                 f"{self.question_field!r}/{self.answer_field!r}")
            out.append(row)
        if not out:
            raise ValueError(f"data file {str(self.path)!r} holds no rows")
        return out

    def _is_test(self, question: str, seed: int) -> bool:
        h = hashlib.sha1(f"{seed}:{question}".encode()).digest()
        return int.from_bytes(h[:4], "big") / 2**32 < self.test_fraction

    def generate(self, split: str, n: int, seed: int) -> list[Problem]:
        # the split must not depend on the per-split seed: use the file-level hash only
        out, seen = [], set()
        for row in self.rows:
            q, a = str(row[self.question_field]), str(row[self.answer_field])
            if q in seen or self._is_test(q, 0) != (split == "test"):
                continue
            seen.add(q)
            out.append(Problem(problem_id(self.name, q), q, a, self.name, {"answer": a}))
            if len(out) >= n:
                break
        return out

    def score(self, problem: Problem, answer: str | None) -> float:
        if answer is None:
            return 0.0
        return 1.0 if _normalise(answer) == _normalise(problem.answer) else 0.0
