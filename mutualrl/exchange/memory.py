"""``memory://`` — an in-process exchange (tests, single-process runs). Not durable."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mutualrl.exchange.base import Exchange, PublishResult, check_kinds
from mutualrl.experience import DEFAULT_LIMITS, KINDS, ExperienceLimits, Record, StoredRow, to_row


class MemoryExchange(Exchange):
    """A dict-backed exchange with the same semantics as the SQLite one, minus durability.

    Thread-safe. ``retain_versions`` (optional) keeps only the newest that many versions.
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
            if self.retain_versions is not None and self._rows and accepted:
                newest = max(r.version for r in self._rows.values())
                self._delete(lambda s, r: r.version <= newest - self.retain_versions)
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

    def query(
        self,
        prompt_ids: Sequence[str],
        kinds: Iterable[str] | None = None,
        exclude_source: str | None = None,
        min_version: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`Exchange.query`."""
        ks = set(check_kinds(kinds))
        with self._lock:
            seqs = sorted({s for p in set(prompt_ids) for s in self._by_prompt.get(p, ())})
            out = [
                r for r in (self._rows[s] for s in seqs)
                if r.kind in ks
                and (exclude_source is None or r.source_policy != exclude_source)
                and (min_version is None or r.version >= min_version)
            ]
        if limit is not None:
            out = out[-limit:] if limit > 0 else []
        return out

    def query_stored(
        self,
        prompt_ids: Sequence[str],
        kinds: Iterable[str] | None = None,
        exclude_source: str | None = None,
        min_version: int | None = None,
        limit: int | None = None,
    ) -> list[StoredRow]:
        """Like :meth:`query` but in storage form (for the Ray backend)."""
        return [to_row(r) for r in self.query(prompt_ids, kinds, exclude_source, min_version, limit)]

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
            }
