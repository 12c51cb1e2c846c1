"""Exchange semantics shared by the in-process backends (``memory://`` and ``sqlite://``)."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_experience import records

from mutualrl.errors import UserError
from mutualrl.exchange import Exchange, PublishResult, open_exchange
from mutualrl.experience import ExperienceLimits, GroupOutcome, Rollout, VerifiedSuccess


def rollout(pid: str = "p1", src: str = "A", version: int = 1, k: int = 0, reward: float = 1.0) -> Rollout:
    return Rollout(pid, f"prompt {pid}", f"completion {k}", src, f"tok-{src}", [1, 2, 3], [-0.1, -0.2, -0.3],
                   reward, version, sample_index=k)


@pytest.fixture(params=["memory", "sqlite"])
def ex(request: pytest.FixtureRequest, tmp_path: Path) -> Exchange:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/see.db"
    e = open_exchange(url)
    yield e
    e.close()


def test_publish_is_idempotent_by_record_id(ex: Exchange) -> None:
    rs = [rollout(k=k) for k in range(5)]
    assert ex.publish(rs) == PublishResult(5, 0, {})
    again = [rollout(k=k) for k in range(3, 7)]  # new objects, new timestamps, 2 already stored
    assert ex.publish(again + again[:1]) == PublishResult(2, 3, {})
    assert ex.stats()["rows"] == 7
    assert sorted(r.sample_index for r in ex.query(["p1"])) == list(range(7))


def test_publish_refuses_invalid_records_and_keeps_the_rest(ex: Exchange) -> None:
    bad = Rollout("p1", "x", "y", "A", "t", [1], [-0.1, -0.2], 1.0, 1)
    nan = Rollout("p1", "x", "y", "A", "t", [1], [float("nan")], 1.0, 1)
    res = ex.publish([rollout(), bad, nan])
    assert (res.accepted, res.rejected) == (1, 2)
    assert res.rejected_by_reason == {"length_mismatch": 1, "non_finite": 1}
    with pytest.raises(TypeError):
        ex.publish([{"kind": "rollout"}])  # type: ignore[list-item]


def test_publish_json_counts_bad_lines_by_reason(ex: Exchange) -> None:
    good = [rollout(k=k).to_json() for k in range(3)]
    lines = [good[0], "{oops", b"\xff\xfe", good[1], '{"kind": "nope"}', rollout(k=9).to_msgpack(), good[2],
             good[0]]
    res = ex.publish_json(lines)
    assert res.accepted == 4 and res.duplicates == 1
    assert res.rejected_by_reason == {"bad_encoding": 2, "unknown_kind": 1}
    assert ex.stats()["rows"] == 4


def test_query_filters(ex: Exchange) -> None:
    ex.publish([rollout("p1", "A", 1), rollout("p1", "B", 1), rollout("p2", "B", 2), rollout("p3", "B", 3)])
    ex.publish([GroupOutcome.from_rewards("p1", "B", [0.0, 1.0], 1),
                VerifiedSuccess("p2", "42", "B", "exact", 1.0, 2)])
    assert len(ex.query(["p1", "p2"])) == 5
    peer = ex.query(["p1", "p2"], exclude_source="A")
    assert {(r.kind, r.source_policy) for r in peer} == {("rollout", "B"), ("group_outcome", "B"),
                                                          ("verified_success", "B")}
    assert [r.kind for r in ex.query(["p1", "p2"], kinds=["group_outcome"])] == ["group_outcome"]
    assert [r.kind for r in ex.query(["p2"], kinds="verified_success")] == ["verified_success"]
    assert {r.prompt_id for r in ex.query(["p1", "p2", "p3"], min_version=2)} == {"p2", "p3"}
    newest = ex.query(["p1", "p2", "p3"], limit=2)
    assert [r.kind for r in newest] == ["group_outcome", "verified_success"]  # oldest first
    assert ex.query(["p1"], limit=0) == [] and ex.query([]) == [] and ex.query(["nope"]) == []
    with pytest.raises(ValueError):
        ex.query(["p1"], kinds=["bogus"])
    got = ex.query(["p1"], exclude_source="A", kinds=["rollout"])[0]
    assert got == rollout("p1", "B", 1) and got.record_id == rollout("p1", "B", 1).record_id


def test_position_prune_and_discard_after(ex: Exchange) -> None:
    assert ex.stats()["max_seq"] == 0 and ex.position() == 0
    ex.publish([rollout(version=v, k=0) for v in range(1, 4)])
    pos = ex.position()
    assert pos >= 3
    ex.publish([rollout(version=v, k=1) for v in range(1, 4)])
    assert ex.position() > pos
    assert ex.discard_after(pos) == 3
    assert ex.stats()["rows"] == 3
    assert ex.prune(3) == 2
    st = ex.stats()
    assert (st["rows"], st["min_version"], st["max_version"]) == (1, 3, 3)
    assert st["by_kind"] == {"rollout": 1, "group_outcome": 0, "verified_success": 0, "peer_score": 0}
    before = ex.position()
    ex.publish([rollout(version=9)])
    assert ex.position() > before  # positions never go back, even after deletes


def test_retention_follows_the_exchange_clock(tmp_path: Path) -> None:
    for url in ("memory://?retain_versions=2", f"sqlite:///{tmp_path}/r.db?retain_versions=2"):
        with open_exchange(url) as ex:
            for v in range(1, 6):
                ex.advance(v)
                ex.publish([rollout(version=v)])
            st = ex.stats()
            assert (st["min_version"], st["max_version"], st["rows"], st["clock"]) == (4, 5, 2, 5), url


def test_a_row_with_a_huge_version_cannot_erase_the_store(tmp_path: Path) -> None:
    """Retention follows the run's clock, and versions far from it are refused: one hostile row with
    version 2**63 - 1 neither lands nor deletes the honest rows (it used to wipe the store)."""
    for url in ("memory://?retain_versions=2", f"sqlite:///{tmp_path}/h.db?retain_versions=2"):
        with open_exchange(url) as ex:
            ex.advance(3)
            honest = [rollout(k=k, version=3) for k in range(4)]
            bomb = rollout(src="X", version=2**63 - 1)
            res = ex.publish_json([r.to_json() for r in honest] + [bomb.to_json()])
            assert res.accepted == 4 and res.rejected_by_reason == {"version_range": 1}, url
            assert ex.publish([bomb]).rejected_by_reason == {"version_range": 1}
            ex.advance(4)
            ex.publish([rollout(k=9, version=4)])
            assert ex.stats()["rows"] == 5, url
            assert {r.sample_index for r in ex.query(["p1"])} == {0, 1, 2, 3, 9}


def test_clock_window_and_persistence(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    limits = ExperienceLimits(version_window=5)
    with open_exchange(url, limits=limits) as ex:
        assert ex.clock is None and ex.publish([rollout(version=10**6)]).accepted == 1  # no clock: no window
        ex.advance(100)
        assert ex.advance(50) == 100  # the clock never goes back
        res = ex.publish([rollout(version=v, k=v) for v in (94, 95, 100, 105, 106)])
        assert res.accepted == 3 and res.rejected_by_reason == {"version_range": 2}
    with open_exchange(url, limits=limits) as ex:  # another process, or a resumed run, sees the clock
        assert ex.clock == 100


def test_typed_publish_rechecks_the_content_id(ex: Exchange) -> None:
    """A record carrying a forged id is refused; the honest row keeps its place."""
    from mutualrl.experience import from_dict

    honest = rollout(k=1)
    forged = from_dict({**rollout(k=2, src="B").to_dict(), "record_id": honest.record_id})
    assert ex.publish([forged]).rejected_by_reason == {"bad_id": 1}
    assert ex.publish([honest]).accepted == 1
    assert [r.source_policy for r in ex.query(["p1"])] == ["A"]


def test_limits_are_applied(tmp_path: Path) -> None:
    limits = ExperienceLimits(reward_range=(0.0, 1.0), known_prompt_ids=frozenset({"p1"}))
    with open_exchange(f"sqlite:///{tmp_path}/l.db", limits=limits) as ex:
        res = ex.publish([rollout(), rollout("p9"), rollout(reward=2.0)])
        assert res.accepted == 1 and res.rejected_by_reason == {"unknown_prompt": 1, "reward_range": 1}


def test_sqlite_persists_across_reopen(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/sub/dir/see.db"  # parent directories are created
    with open_exchange(url) as ex:
        ex.publish([rollout(k=k) for k in range(4)])
        pos = ex.position()
    with open_exchange(url) as ex:
        assert ex.stats()["rows"] == 4 and ex.position() == pos
        assert ex.publish([rollout(k=0)]).duplicates == 1


def test_named_memory_exchange_is_shared_in_process() -> None:
    a, b = open_exchange("memory://shared-test"), open_exchange("memory://shared-test")
    a.publish([rollout()])
    assert b.stats()["rows"] == 1
    assert open_exchange("memory://").stats()["rows"] == 0


@pytest.mark.parametrize(
    "url",
    ["", "see.db", "ftp://x", "sqlite://", "sqlite:///", "sqlite:///x.db?bogus=1", "sqlite:///x.db?synchronous=maybe",
     "memory://?retain_versions=0", "sqlite:///x.db?retain_versions=abc", "ray://", "ray://a/b"],
)
def test_bad_urls_are_user_errors(url: str) -> None:
    with pytest.raises(UserError):
        open_exchange(url)


def test_unopenable_databases_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="directory"):
        open_exchange(f"sqlite:///{tmp_path}")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="junk.db"):
        open_exchange(f"sqlite:///{junk}")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot open"):
        open_exchange(f"sqlite:///{blocker}/see.db")


def test_locked_database_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    open_exchange(f"sqlite:///{path}").close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(UserError, match="locked") as exc:
            open_exchange(f"sqlite:///{path}?busy_timeout_s=0.2")
        assert str(path) in str(exc.value)
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_schema_version_mismatch_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(UserError, match="schema version 99"):
        open_exchange(f"sqlite:///{path}")


def _indexes(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    finally:
        conn.close()


def test_new_files_key_rows_by_prompt_version_and_id(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    with open_exchange(f"sqlite:///{path}") as ex:
        rs = [rollout(f"p{i % 3}", version=i % 2, k=i) for i in range(12)]
        assert ex.publish(rs).accepted == 12
        assert ex.publish(rs[::-1]) == PublishResult(0, 12, {})  # exactly once under the new key
    assert _indexes(path) == {"experience_key", "experience_version"}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    conn.close()


def test_schema_1_files_are_read_and_written_as_they_are(tmp_path: Path) -> None:
    from mutualrl.exchange import sqlite as sq

    path = tmp_path / "v1.db"
    ddl = sq._SCHEMA.replace("record_id TEXT NOT NULL,", "record_id TEXT NOT NULL UNIQUE,").replace(
        "CREATE UNIQUE INDEX IF NOT EXISTS experience_key ON experience(prompt_id, version, record_id)",
        "CREATE INDEX IF NOT EXISTS experience_prompt_version ON experience(prompt_id, version)")
    assert ddl != sq._SCHEMA
    conn = sqlite3.connect(path)
    conn.executescript(ddl.replace(sq._CLOCK_TABLE + ";", ""))  # a schema-1 file of before the clock
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    rs = [rollout(k=k) for k in range(4)]
    with open_exchange(f"sqlite:///{path}") as ex:
        assert ex.publish(rs).accepted == 4
        ex.advance(3)
    with open_exchange(f"sqlite:///{path}") as ex:
        assert ex.publish(rs) == PublishResult(0, 4, {})
        assert [r.record_id for r in ex.query(["p1"])] == [r.record_id for r in rs]
        assert ex.clock == 3
    assert _indexes(path) == {"experience_prompt_version", "experience_version"}


def test_large_prompt_id_lists_are_chunked(ex: Exchange) -> None:
    ex.publish([rollout(f"p{i}", version=i % 7) for i in range(1200)])
    ids = [f"p{i}" for i in range(1500)]
    assert len(ex.query(ids)) == 1200
    newest = ex.query(ids, limit=3)
    assert [r.prompt_id for r in newest] == ["p1197", "p1198", "p1199"]
    assert len(ex.query(ids, min_version=6)) == len([i for i in range(1200) if i % 7 >= 6])


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@settings(max_examples=25, deadline=None)
@given(recs=st.lists(records, max_size=6))
def test_stored_records_come_back_equal(backend: str, recs: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ex = open_exchange("memory://" if backend == "memory" else f"sqlite:///{tmp}/see.db")
        ex.publish(recs)
        got = {r.record_id: r for r in ex.query([r.prompt_id for r in recs])}
        first: dict[str, float] = {}
        for r in recs:
            first.setdefault(r.record_id, r.created_at)  # a duplicate keeps the first timestamp
            back = got[r.record_id]
            assert back == r and type(back) is type(r) and back.created_at == first[r.record_id]
        ex.close()


def test_gc_paused_restores_the_collector_state_even_on_error():
    import gc

    from mutualrl.exchange.base import gc_paused

    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner exit must not re-enable
            pass
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()

    @gc_paused()
    def inside() -> bool:
        return gc.isenabled()

    assert inside() is False and inside() is False and gc.isenabled()  # as a decorator, every call
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's choice to keep it off is kept
    finally:
        gc.enable()
