"""``sqlite:///path`` — the embedded, durable default exchange.

One table, one row per record:

* ``seq`` (INTEGER PRIMARY KEY AUTOINCREMENT): the monotonically increasing position;
* a UNIQUE index on ``(prompt_id, version, record_id)`` + ``INSERT OR IGNORE``: idempotent
  publish, exactly once. Every path into the store checks that ``record_id`` is the digest of the
  record's content, which includes ``prompt_id`` and ``version``, so one id has one prompt and one
  version, and the key is unique exactly when ``record_id`` is. Unlike a key on the random id
  alone, it keeps a batch's index writes on the few leaf pages of its prompts (a batch of 256
  rows touched ~256 pages of a ``record_id`` index), and it is the per-step query's index too;
* ``version`` index for retention;
* ``v0..vN`` (untyped) and ``arrays``: the record's scalar fields in field order, and its
  numeric lists packed little-endian (:func:`~mutualrl.experience.to_row`); several times
  faster to write and to read back than JSON text.

The database runs in WAL mode; each publish batch is one ``BEGIN IMMEDIATE`` transaction, so a
committed batch survives ``kill -9`` of the writer (and, with ``synchronous=full``, power loss),
readers only ever see whole committed batches, and several writer processes take turns on the
write lock (``busy_timeout``) instead of failing.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from typing import Any

from mutualrl.errors import UserError
from mutualrl.exchange.base import Exchange, PublishResult, Query
from mutualrl.experience import (
    DEFAULT_LIMITS,
    KINDS,
    RECORD_TYPES,
    ExperienceLimits,
    Record,
    StoredRow,
    to_row,
)
from mutualrl.run.faults import fault_point  # crash-test hook: inert unless MUTUALRL_FAULT_POINT=publish:<n>

DB_SCHEMA_VERSION = 2
"""Schema of new files. Files of schema 1 (``record_id UNIQUE`` and a ``(prompt_id, version)``
index; same columns, same guarantees, slower to write) are opened and used as they are."""
_READABLE_SCHEMAS = (1, 2)
_SYNC_MODES = ("off", "normal", "full", "extra")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experience (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    source_policy TEXT NOT NULL,
    version INTEGER NOT NULL,
    {value_columns},
    arrays BLOB NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS experience_key ON experience(prompt_id, version, record_id);
CREATE INDEX IF NOT EXISTS experience_version ON experience(version);
{clock_table};
"""
_CLOCK_TABLE = "CREATE TABLE IF NOT EXISTS exchange_clock (id INTEGER PRIMARY KEY CHECK (id = 0), step INTEGER NOT NULL)"

_NV = max(len(cls.SCALAR_FIELDS) for cls in RECORD_TYPES.values())
_VCOLS = [f"v{i}" for i in range(_NV)]
_SCHEMA = _SCHEMA.replace("{value_columns}", ",\n    ".join(_VCOLS)).replace("{clock_table}", _CLOCK_TABLE)
_INSERT = (
    f"INSERT OR IGNORE INTO experience(record_id, kind, prompt_id, source_policy, version, "
    f"{', '.join(_VCOLS)}, arrays) VALUES ({', '.join('?' * (_NV + 6))})"
)
_NSCALARS = {kind: len(cls.SCALAR_FIELDS) for kind, cls in RECORD_TYPES.items()}
_SELECT = f"SELECT seq, kind, record_id, arrays, {', '.join(_VCOLS)} FROM experience"


_MAX_IDS_PER_QUERY = 500


def _first(row: tuple) -> Any:
    return row[0]


def _query_sql(pids: list[str], q: Query) -> tuple[str, list[Any]]:
    sql = [f"{_SELECT} WHERE prompt_id IN ({','.join('?' * len(pids))})"]
    args: list[Any] = list(pids)
    if q.min_version is not None:
        sql.append("AND version >= ?")
        args.append(q.min_version)
    if q.exclude_source is not None:
        sql.append("AND source_policy != ?")
        args.append(q.exclude_source)
    if len(q.kinds) < len(KINDS):
        sql.append(f"AND kind IN ({','.join('?' * len(q.kinds))})")
        args.extend(q.kinds)
    if q.limit is not None:
        sql.append("ORDER BY seq DESC LIMIT ?")
        args.append(q.limit)
    return " ".join(sql), args


def _journal_mode_wal(conn: sqlite3.Connection, wait_s: float) -> str:
    """Switch ``conn``'s file to WAL, retrying while another process opens the same new file: two
    processes switching a fresh file at once (the ranks of one policy start together) can get
    ``database is locked`` at once, without SQLite's busy handler waiting."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02 + 0.08 * random.random())


class SQLiteExchange(Exchange):
    """A durable exchange in one SQLite file; safe for several processes and threads.

    Args:
        path: database file (created with its parent directories if missing).
        limits: validation limits for incoming records.
        synchronous: SQLite ``synchronous`` mode; ``normal`` (default) survives process crashes,
            ``full`` also survives power loss at some cost per batch.
        busy_timeout_s: how long a writer waits for another writer's batch before failing.
        retain_versions: when set, keep only the newest that many versions of the exchange's clock.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: ExperienceLimits | None = None,
        synchronous: str = "normal",
        busy_timeout_s: float = 60.0,
        retain_versions: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.limits = limits or DEFAULT_LIMITS
        self.retain_versions = retain_versions
        if synchronous not in _SYNC_MODES:
            raise UserError(f"sqlite exchange: synchronous={synchronous!r}; use one of {_SYNC_MODES}")
        self._lock = threading.Lock()
        self._conn = self._open(synchronous, busy_timeout_s)

    # -- setup -----------------------------------------------------------------------------
    def _open(self, synchronous: str, busy_timeout_s: float) -> sqlite3.Connection:
        path = self.path
        if os.path.isdir(path):
            raise UserError(f"exchange database {path!r} is a directory; give a file path such as "
                            f"sqlite:///{os.path.join(path, 'exchange.db')}")
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"cannot open exchange database {path!r}: {exc}. Check that the directory "
                            "exists and is writable, or choose another path.") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = _journal_mode_wal(conn, busy_timeout_s)
            if str(mode).lower() != "wal":
                raise UserError(f"exchange database {path!r} cannot use WAL mode (got {mode!r}); "
                                "put it on a local filesystem (not NFS) that supports shared memory.")
            conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            conn.execute("PRAGMA cache_size = -65536")  # 64 MiB page cache: keep the indexes hot
            # checkpoint the WAL into the database every ~40 MB instead of every ~4 MB: every page a
            # batch touches (index pages above all) is copied and fsynced once per checkpoint, not
            # once per few batches (1.45x publish throughput); durability is the WAL's, unchanged
            conn.execute("PRAGMA wal_autocheckpoint = 10000")
            conn.execute("BEGIN IMMEDIATE")
            try:
                have = conn.execute("PRAGMA user_version").fetchone()[0]
                if have not in (0, *_READABLE_SCHEMAS):
                    raise UserError(f"exchange database {path!r} has schema version {have}, this mutualrl "
                                    f"reads {list(_READABLE_SCHEMAS)}; use a new file or another mutualrl.")
                if have == 0:
                    for stmt in filter(str.strip, _SCHEMA.split(";")):
                        conn.execute(stmt)
                    conn.execute(f"PRAGMA user_version = {DB_SCHEMA_VERSION}")
                else:  # a file of an earlier schema keeps its indexes; only the clock may be new to it
                    conn.execute(_CLOCK_TABLE)
                row = conn.execute("SELECT step FROM exchange_clock WHERE id = 0").fetchone()
                self.clock = int(row[0]) if row else None
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            conn.close()
            if "locked" in str(exc) or "busy" in str(exc):
                raise UserError(f"exchange database {path!r} is locked by another process for longer than "
                                f"{busy_timeout_s:g}s; stop the other run or use another path.") from exc
            raise UserError(f"cannot open exchange database {path!r}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise UserError(f"{path!r} is not a usable exchange database ({exc}); delete it or choose "
                            "another path.") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    # -- writing ---------------------------------------------------------------------------
    def _store(self, records: list[Record], rejected: dict[str, int]) -> PublishResult:
        if not records:
            return PublishResult(0, 0, rejected)
        rows = []
        pad = (None,) * _NV
        for r in records:
            kind, rid, scalars, blob = to_row(r)
            rows.append((rid, kind, r.prompt_id, r.source_policy, r.version, *(scalars + pad)[:_NV], blob))
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                before = conn.total_changes
                conn.executemany(_INSERT, rows)
                accepted = conn.total_changes - before
                fault_point("publish")  # crash tests: die with the batch written but not committed
                floor = self.retention_floor(self.retain_versions)
                if floor is not None and accepted:  # the exchange's clock, never a row's claim
                    conn.execute("DELETE FROM experience WHERE version < ?", (floor,))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return PublishResult(accepted, len(rows) - accepted, rejected)

    # -- the clock -------------------------------------------------------------------------
    def advance(self, step: int) -> int:
        """See :meth:`Exchange.advance`; the clock is stored, so every process sharing the file
        and a reopened exchange see it."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT INTO exchange_clock(id, step) VALUES (0, ?) ON CONFLICT(id) DO UPDATE "
                             "SET step = MAX(step, excluded.step)", (int(step),))
                self.clock = int(conn.execute("SELECT step FROM exchange_clock WHERE id = 0").fetchone()[0])
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return self.clock

    # -- reading ---------------------------------------------------------------------------
    def read(self, query: Query) -> list[StoredRow]:
        """See :meth:`Exchange.read`."""
        if query.empty:
            return []
        pids = list(query.prompt_ids)
        rows: list[tuple] = []
        chunks = [pids[i:i + _MAX_IDS_PER_QUERY] for i in range(0, len(pids), _MAX_IDS_PER_QUERY)]
        with self._lock:
            conn = self._conn
            if len(chunks) > 1:  # one read snapshot across the chunks: whole batches only
                conn.execute("BEGIN")
            try:
                for chunk in chunks:  # chunked to stay under SQLite's bound-variable cap
                    sql, args = _query_sql(chunk, query)
                    rows.extend(conn.execute(sql, args).fetchall())
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")
        rows.sort(key=_first)  # by seq; cheaper here than SQLite's sorter copying whole rows
        if query.limit is not None:
            rows = rows[-query.limit:]
        out = []
        for row in rows:
            kind = row[1]
            out.append((kind, row[2], row[4:4 + _NSCALARS[kind]], row[3]))
        return out

    def stats(self) -> dict[str, Any]:
        """See :meth:`Exchange.stats`."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN")
            try:
                by_kind = dict.fromkeys(KINDS, 0)
                for kind, n in conn.execute("SELECT kind, COUNT(*) FROM experience GROUP BY kind"):
                    by_kind[kind] = n
                lo, hi = conn.execute("SELECT MIN(version), MAX(version) FROM experience").fetchone()
                seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'experience'").fetchone()
            finally:
                conn.execute("COMMIT")
        return {
            "backend": "sqlite",
            "path": self.path,
            "rows": sum(by_kind.values()),
            "by_kind": by_kind,
            "max_seq": int(seq[0]) if seq else 0,
            "min_version": lo,
            "max_version": hi,
            "clock": self.clock,
        }

    # -- retention -------------------------------------------------------------------------
    def _delete(self, where: str, arg: int) -> int:
        with self._lock:
            cur = self._conn.execute(f"DELETE FROM experience WHERE {where}", (int(arg),))
            return cur.rowcount

    def prune(self, older_than_version: int) -> int:
        """See :meth:`Exchange.prune`."""
        return self._delete("version < ?", older_than_version)

    def discard_after(self, position: int) -> int:
        """See :meth:`Exchange.discard_after`."""
        return self._delete("seq > ?", position)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]
