"""``memory://`` — an in-process exchange (tests, single-process runs). Not durable."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mutualrl.exchange.base import Exchange, PublishResult, Query
from mutualrl.experience import DEFAULT_LIMITS, KINDS, ExperienceLimits, Record, StoredRow, to_row


class MemoryExchange(Exchange):
    """A dict-backed exchange with the same semantics as the SQLite one, minus durability.

    Thread-safe. ``retain_versions`` (optional) keeps only the newest that many versions of the
    exchange's clock.
    """

    def __init__(self, limits: ExperienceLimits | None = None, retain_versions: int | None = None) -> None:
        self.limits = limits or DEFAULT_LIMITS
        self.retain_versions = retain_versions
        self._lock = threading.Lock()
        self._by_id: dict[str, int] = {}
        self._rows: dict[int, Record] = {}  # seq -> record (insertion order == seq order)
        self._by_prompt: dict[str, dict[int, None]] = {}
        self._seq = 0

    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        accepted = dups = 0
        with self._lock:
            for r in records:
                rid = r.record_id
                if rid in self._by_id:
                    dups += 1
                    continue
                self._seq += 1
                self._by_id[rid] = self._seq
                self._rows[self._seq] = r
                self._by_prompt.setdefault(r.prompt_id, {})[self._seq] = None
                accepted += 1
            floor = self.retention_floor(self.retain_versions)
            if floor is not None and accepted:
                self._delete(lambda s, r: r.version < floor)
        return PublishResult(accepted, dups, rejected)

    def _delete(self, pred: Callable[[int, Record], bool]) -> int:
        doomed = [(s, r) for s, r in self._rows.items() if pred(s, r)]
        for s, r in doomed:
            del self._rows[s]
            del self._by_id[r.record_id]
            rows = self._by_prompt[r.prompt_id]
            del rows[s]
            if not rows:
                del self._by_prompt[r.prompt_id]
        return len(doomed)

    def read(self, query: Query) -> list[StoredRow]:
        """See :meth:`Exchange.read`."""
        if query.empty:
            return []
        with self._lock:
            seqs = sorted({s for p in query.prompt_ids for s in self._by_prompt.get(p, ())})
            out = [r for r in (self._rows[s] for s in seqs) if query.matches(r.kind, r.source_policy, r.version)]
        if query.limit is not None:
            out = out[-query.limit:]
        return [to_row(r) for r in out]

    def prune(self, older_than_version: int) -> int:
        """See :meth:`Exchange.prune`."""
        with self._lock:
            return self._delete(lambda s, r: r.version < older_than_version)

    def discard_after(self, position: int) -> int:
        """See :meth:`Exchange.discard_after`."""
        with self._lock:
            return self._delete(lambda s, r: s > position)

    def stats(self) -> dict[str, Any]:
        """See :meth:`Exchange.stats`."""
        with self._lock:
            by_kind = dict.fromkeys(KINDS, 0)
            for r in self._rows.values():
                by_kind[r.kind] += 1
            versions = [r.version for r in self._rows.values()]
            return {
                "backend": "memory",
                "rows": len(self._rows),
                "by_kind": by_kind,
                "max_seq": self._seq,
                "min_version": min(versions) if versions else None,
                "max_version": max(versions) if versions else None,
                "clock": self.clock,
            }
