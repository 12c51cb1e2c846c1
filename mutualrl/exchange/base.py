"""The exchange protocol shared by every SEE backend (``memory``, ``sqlite``, ``ray``).

An exchange stores validated, typed experience records keyed by prompt id. Its contract:

* ``publish`` is idempotent by ``record_id``: republishing a record (e.g. after a crash) adds
  nothing and is counted as a duplicate.
* A batch is atomic: after ``publish`` returns, the whole batch is visible to every reader and
  durable (for the durable backends); before, none of it is.
* Every accepted row gets a sequence number that only ever grows; ``stats()["max_seq"]`` is the
  exchange's *position*, which a checkpoint records so that a resume can drop what was written
  after it (:meth:`Exchange.discard_after`).
* Input from peers (``publish_json``) is parsed and validated line by line; a bad line is
  counted by reason and never stops the good ones, whatever its bytes.
* The exchange has its own clock, the run's current step (:meth:`Exchange.advance`, called by
  the run's workers). Once set, rows whose version lies more than ``limits.version_window``
  steps from it are refused, and retention (``retain_versions``) follows the clock: nothing a
  row says can delete or hide other rows.
* Reads take one frozen :class:`Query`; the backends implement :meth:`Exchange.read` only.
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

from mutualrl.experience import (
    DEFAULT_LIMITS,
    KINDS,
    RECORD_TYPES,
    ExperienceLimits,
    InvalidExperience,
    Record,
    StoredRow,
    from_row,
    parse,
    parse_row,
    validate,
)


@dataclass(frozen=True)
class PublishResult:
    """What one ``publish`` call did: rows newly stored, rows already there, rows refused."""

    accepted: int = 0
    duplicates: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def rejected(self) -> int:
        """Total number of refused rows."""
        return sum(self.rejected_by_reason.values())

    def __add__(self, other: PublishResult) -> PublishResult:
        reasons = Counter(self.rejected_by_reason)
        reasons.update(other.rejected_by_reason)
        return PublishResult(self.accepted + other.accepted, self.duplicates + other.duplicates, dict(reasons))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {"accepted": self.accepted, "duplicates": self.duplicates,
                "rejected_by_reason": dict(self.rejected_by_reason)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PublishResult:
        """Inverse of :meth:`to_dict`."""
        return cls(int(d["accepted"]), int(d["duplicates"]), dict(d["rejected_by_reason"]))


_RECORD_CLASSES = tuple(RECORD_TYPES.values())


def check_kinds(kinds: Iterable[str] | None) -> tuple[str, ...]:
    """Normalise a ``kinds`` filter (``None`` means all kinds); reject unknown kind names."""
    if kinds is None:
        return KINDS
    if isinstance(kinds, str):
        kinds = (kinds,)
    out = tuple(dict.fromkeys(kinds))
    bad = [k for k in out if k not in RECORD_TYPES]
    if bad:
        raise ValueError(f"unknown record kinds {bad}; known: {list(KINDS)}")
    return out


@dataclass(frozen=True)
class Query:
    """What to read: records for ``prompt_ids`` (deduplicated, in order), of ``kinds``, not from
    ``exclude_source``, of version ``>= min_version``, the newest ``limit`` of them; oldest first."""

    prompt_ids: tuple[str, ...]
    kinds: tuple[str, ...] = KINDS
    exclude_source: str | None = None
    min_version: int | None = None
    limit: int | None = None

    @classmethod
    def build(cls, prompt_ids: Sequence[str], kinds: Iterable[str] | None = None, exclude_source: str | None = None,
              min_version: int | None = None, limit: int | None = None) -> Query:
        """A validated query (``ValueError`` for unknown kinds)."""
        return cls(tuple(dict.fromkeys(prompt_ids)), check_kinds(kinds), exclude_source,
                   None if min_version is None else int(min_version), None if limit is None else int(limit))

    @property
    def empty(self) -> bool:
        """True when nothing can match (no prompt ids, or ``limit <= 0``)."""
        return not self.prompt_ids or (self.limit is not None and self.limit <= 0)

    def matches(self, kind: str, source: str, version: int) -> bool:
        """Whether a row of this kind, source and version passes the filters (prompt id aside)."""
        return (kind in self.kinds and (self.exclude_source is None or source != self.exclude_source)
                and (self.min_version is None or version >= self.min_version))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (for sending the query to another process)."""
        return {"prompt_ids": list(self.prompt_ids), "kinds": list(self.kinds), "exclude_source": self.exclude_source,
                "min_version": self.min_version, "limit": self.limit}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Query:
        """Inverse of :meth:`to_dict` (validated again)."""
        return cls.build(d["prompt_ids"], d["kinds"], d["exclude_source"], d["min_version"], d["limit"])


@contextmanager
def gc_paused() -> Iterator[None]:
    """Suspend Python's cyclic garbage collector while a batch of rows is parsed, encoded or decoded.

    A batch builds thousands of small acyclic objects; each few hundred allocations would otherwise
    start a collection that walks every tracked object of the process (in a worker that has torch
    and transformers loaded, a full collection takes tens of milliseconds). Reference counting
    still frees everything; collection resumes when the batch is done. Safe to nest; also a
    decorator (``@gc_paused()``)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Exchange(ABC):
    """Protocol of a Shared Experience Exchange. Backends implement the abstract methods."""

    limits: ExperienceLimits = DEFAULT_LIMITS
    clock: int | None = None
    """The run's current step as this exchange knows it (None until :meth:`advance`)."""

    # -- the clock -------------------------------------------------------------------------
    def advance(self, step: int) -> int:
        """Move the exchange's clock to ``step`` (it never goes back); returns the clock."""
        self.clock = max(int(step), self.clock if self.clock is not None else int(step))
        return self.clock

    def version_error(self, version: int) -> InvalidExperience | None:
        """The refusal of a row with ``version`` under the clock's window, or None if it is in it."""
        if self.clock is None:
            return None
        w = self.limits.version_window
        if abs(version - self.clock) > w:
            return InvalidExperience("version_range", f"version {version} is more than {w} steps from the "
                                     f"exchange's clock {self.clock}")
        return None

    # -- writing ---------------------------------------------------------------------------
    @gc_paused()
    def publish(self, records: Iterable[Record]) -> PublishResult:
        """Validate and store ``records`` as one atomic batch.

        Invalid records are refused (counted in ``rejected_by_reason``), the rest are stored; a
        record whose ``record_id`` does not match its content is refused (``bad_id``). Raises
        ``TypeError`` for objects that are not records (a programming error).
        """
        valid: list[Record] = []
        rejected: Counter[str] = Counter()
        for r in records:
            if not isinstance(r, _RECORD_CLASSES):
                raise TypeError(f"publish() takes experience records, got {type(r).__name__}")
            try:
                validate(r, self.limits)
                claimed = r.__dict__.get("record_id")
                if claimed is not None and claimed != r.content_id():
                    raise InvalidExperience("bad_id", "record_id does not match the record's content")
                err = self.version_error(r.version)
                if err is not None:
                    raise err
            except InvalidExperience as exc:
                rejected[exc.reason] += 1
                continue
            valid.append(r)
        return self._store(valid, dict(rejected))

    def publish_json(self, lines: Iterable[str | bytes | dict]) -> PublishResult:
        """Parse, validate and store records from an untrusted peer (one JSON object per line).

        Each line is judged on its own: bad lines are counted by reason, good lines are stored
        together as one atomic batch. Nothing a line holds makes this raise.
        """
        return self._accept(lines, parse)

    def publish_rows(self, rows: Iterable[Any]) -> PublishResult:
        """Like :meth:`publish_json` for rows in storage form (``[kind, record_id or None, scalars,
        packed arrays]``, the compact wire format clients of a remote exchange send), each parsed and
        validated on its own."""
        return self._accept(rows, parse_row)

    @gc_paused()
    def _accept(self, items: Iterable[Any], parser: Any) -> PublishResult:
        valid: list[Record] = []
        rejected: Counter[str] = Counter()
        for item in items:
            try:
                r = parser(item, self.limits)
                err = self.version_error(r.version)
                if err is not None:
                    raise err
                valid.append(r)
            except InvalidExperience as exc:
                rejected[exc.reason] += 1
        return self._store(valid, dict(rejected))

    @abstractmethod
    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        """Store already-validated records atomically; return the result incl. ``rejected``."""

    # -- reading ---------------------------------------------------------------------------
    @abstractmethod
    def read(self, query: Query) -> list[StoredRow]:
        """The rows matching ``query`` in storage form (:func:`~mutualrl.experience.to_row`), oldest first."""

    @gc_paused()
    def query(self, prompt_ids: Sequence[str], kinds: Iterable[str] | None = None, exclude_source: str | None = None,
              min_version: int | None = None, limit: int | None = None) -> list[Record]:
        """Records for ``prompt_ids``, oldest first (see :class:`Query` for the filters)."""
        return [from_row(*row) for row in self.read(Query.build(prompt_ids, kinds, exclude_source, min_version, limit))]

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: ``rows``, ``by_kind``, ``max_seq`` (the position), ``min_version``,
        ``max_version``, ``clock`` and ``backend``."""

    def position(self) -> int:
        """The exchange's position: the highest sequence number ever assigned (0 when empty)."""
        return int(self.stats()["max_seq"])

    # -- retention and resume ---------------------------------------------------------------
    @abstractmethod
    def prune(self, older_than_version: int) -> int:
        """Delete rows with ``version < older_than_version``; return how many were deleted."""

    @abstractmethod
    def discard_after(self, position: int) -> int:
        """Delete rows stored after ``position`` (a value of ``max_seq``); for exact resume."""

    def retention_floor(self, retain_versions: int | None) -> int | None:
        """The oldest version ``retain_versions`` keeps, from the clock (None: keep everything)."""
        if retain_versions is None or self.clock is None:
            return None
        return self.clock - retain_versions + 1

    def close(self) -> None:
        """Release resources. The exchange must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
