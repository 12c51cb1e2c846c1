"""User data as a task source: JSONL or Parquet files with question/answer columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mutualrl.tasks.rows import RowSource, SourceFieldError


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` or ``.parquet`` file (``SourceFieldError`` on ``path`` if unreadable)."""
    if not path.is_file():
        raise SourceFieldError("path", f"data file {str(path)!r} does not exist")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        else:
            rows = []
            with path.open("r", encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise SourceFieldError("path", f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceFieldError("path", f"cannot read data file {str(path)!r}: {exc}") from None
    except ImportError:
        raise SourceFieldError("path", "reading Parquet needs pyarrow: pip install pyarrow") from None
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SourceFieldError("path", f"{path}: row {i} is not an object")
    if not rows:
        raise SourceFieldError("path", f"data file {str(path)!r} holds no rows")
    return rows


class FileSource(RowSource):
    """Problems read from a ``.jsonl`` or ``.parquet`` file (see :class:`~mutualrl.tasks.rows.RowSource`).

    The test split holds the rows whose question hashes below ``test_fraction``; the verifier is
    ``exact`` (numbers compared as numbers, case and whitespace folded) or ``math``.
    """

    def __init__(self, path: str | Path, name: str | None = None, question_field: str | None = None,
                 answer_field: str | None = None, test_fraction: float = 0.2, *, answer_extractor: str = "raw",
                 verifier: str = "exact") -> None:
        self.path = Path(path)
        super().__init__(name or self.path.stem, read_rows(self.path), question_field=question_field,
                         answer_field=answer_field, answer_extractor=answer_extractor, verifier=verifier,
                         test_fraction=test_fraction)
