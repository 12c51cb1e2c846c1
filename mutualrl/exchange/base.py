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
  counted by reason and never stops the good ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from mutualrl.experience import (
    DEFAULT_LIMITS,
    KINDS,
    RECORD_TYPES,
    ExperienceLimits,
    InvalidExperience,
    Record,
    parse,
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


class Exchange(ABC):
    """Protocol of a Shared Experience Exchange. Backends implement the abstract methods."""

    limits: ExperienceLimits = DEFAULT_LIMITS

    # -- writing ---------------------------------------------------------------------------
    def publish(self, records: Iterable[Record]) -> PublishResult:
        """Validate and store ``records`` as one atomic batch.

        Invalid records are refused (counted in ``rejected_by_reason``), the rest are stored.
        Raises ``TypeError`` for objects that are not records (a programming error).
        """
        valid: list[Record] = []
        rejected: Counter[str] = Counter()
        for r in records:
            if not isinstance(r, _RECORD_CLASSES):
                raise TypeError(f"publish() takes experience records, got {type(r).__name__}")
            try:
                validate(r, self.limits)
            except InvalidExperience as exc:
                rejected[exc.reason] += 1
                continue
            valid.append(r)
        return self._store(valid, dict(rejected))

    def publish_json(self, lines: Iterable[str | bytes | dict]) -> PublishResult:
        """Parse, validate and store records from an untrusted peer (one JSON object per line).

        Each line is judged on its own: bad lines are counted by reason, good lines are stored
        together as one atomic batch.
        """
        valid: list[Record] = []
        rejected: Counter[str] = Counter()
        for line in lines:
            try:
                valid.append(parse(line, self.limits))
            except InvalidExperience as exc:
                rejected[exc.reason] += 1
        return self._store(valid, dict(rejected))

    @abstractmethod
    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        """Store already-validated records atomically; return the result incl. ``rejected``."""

    # -- reading ---------------------------------------------------------------------------
    @abstractmethod
    def query(
        self,
        prompt_ids: Sequence[str],
        kinds: Iterable[str] | None = None,
        exclude_source: str | None = None,
        min_version: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Records for ``prompt_ids``, oldest first.

        ``kinds`` filters by record kind (default all), ``exclude_source`` drops one policy's own
        rows, ``min_version`` drops rows older than that policy version, and ``limit`` keeps the
        newest ``limit`` matches.
        """

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: ``rows``, ``by_kind``, ``max_seq`` (the position), ``min_version``,
        ``max_version`` and ``backend``."""

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

    def close(self) -> None:
        """Release resources. The exchange must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
