"""``ray://`` exchange on a real local Ray cluster: two writer actors and a reader, no mocks."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from mutualrl.exchange import open_exchange
from mutualrl.experience import GroupOutcome, Rollout

BATCH = 40


def make_batch(writer: str, b: int) -> list[Rollout]:
    """Batch b of a writer; even batches are identical for all writers (shared ids)."""
    owner = "shared" if b % 2 == 0 else writer
    return [Rollout(f"p{b}", "prompt", f"c{k}", owner, "tok", [k, k + 1], [-0.5, -0.25], 0.5, b,
                    sample_index=k) for k in range(BATCH)]


class Writer:
    """A Ray actor that opens the exchange by URL and publishes batches."""

    def __init__(self, url: str, name: str) -> None:
        self.ex = open_exchange(url)
        self.name = name

    def run(self, n: int) -> dict[str, int]:
        acc = dup = 0
        for b in range(n):
            res = self.ex.publish(make_batch(self.name, b))
            acc, dup = acc + res.accepted, dup + res.duplicates
        bad = self.ex.publish_json(["{", make_batch(self.name, 0)[0].to_json().replace("0.5", "9e999")])
        return {"accepted": acc, "duplicates": dup, "rejected": bad.rejected}

    def position(self) -> int:
        return self.ex.position()


@pytest.fixture(scope="module")
def ray_cluster(shared_ray) -> Iterator[None]:
    # Ship this module's classes to the workers by value (tests/ is not importable there).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    shared_ray()  # the session's Ray (conftest.py), left up
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_two_writer_actors_and_a_reader(ray_cluster: None, tmp_path: Path) -> None:
    url = f"ray://see-test?store=sqlite:///{tmp_path}/ray.db"
    reader = open_exchange(url)  # the driver creates the actor; the writers get the same one by name
    writer_cls = ray.remote(num_cpus=0)(Writer)
    writers = [writer_cls.remote(url, "w1"), writer_cls.remote(url, "w2")]
    n = 30
    results = ray.get([w.run.remote(n) for w in writers], timeout=120)
    shared, own = n // 2, n // 2
    union = (shared + 2 * own) * BATCH
    assert sum(r["accepted"] for r in results) == union
    assert sum(r["duplicates"] for r in results) == shared * BATCH
    assert [r["rejected"] for r in results] == [2, 2]  # garbage and an infinite reward, per writer

    st = reader.stats()
    assert st["rows"] == union and st["backend"] == "sqlite" and st["ray_name"] == "see-test"
    assert ray.get(writers[0].position.remote()) == reader.position()
    peer = reader.query([f"p{b}" for b in range(n)], exclude_source="w1")
    assert {r.source_policy for r in peer} == {"shared", "w2"}
    assert len(peer) == (shared + own) * BATCH
    assert peer[0] == make_batch("w1", 0)[0] and peer[0].record_id == make_batch("w1", 0)[0].record_id
    assert reader.query(["p1"], kinds=["group_outcome"]) == []
    assert reader.prune(n - 2) == (n - 2 + (n - 2) // 2) * BATCH
    assert reader.discard_after(reader.position()) == 0
    reader.destroy()


def test_memory_store_and_validation_over_the_wire(ray_cluster: None) -> None:
    ex = open_exchange("ray://see-mem")
    g = GroupOutcome.from_rewards("p1", "A", [0.0, 1.0], 1)
    bad = GroupOutcome("p1", "A", [0.0, 1.0], 0.9, 0.5, 1)  # inconsistent mean: the actor refuses it
    res = ex.publish([g, bad, g])
    assert (res.accepted, res.duplicates, res.rejected_by_reason) == (1, 1, {"inconsistent": 1})
    res = ex.publish_json([g.to_dict(), {"kind": "rollout", "x": float("nan")}, b"\x00\x01", 5])
    assert res.duplicates == 1 and res.rejected == 3
    assert ex.query(["p1"]) == [g]
    ex.close()  # drops this handle only: the actor and its memory store live on
    same = open_exchange("ray://see-mem")  # get-or-create: the same actor
    assert same.stats()["rows"] == 1 and same.stats()["backend"] == "memory"
    same.destroy()
    deadline = time.monotonic() + 20  # destroy() ends the actor (ray.kill is asynchronous)
    while time.monotonic() < deadline:
        try:
            ray.get_actor("mutualrl-exchange:see-mem", namespace="mutualrl")
        except ValueError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the destroyed exchange actor is still registered")
