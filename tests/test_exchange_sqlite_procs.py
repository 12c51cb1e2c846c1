"""SQLite exchange across processes: concurrent writers, and durability under ``kill -9``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from mutualrl.exchange import open_exchange

BATCH = 50

# Deterministic batches: batch b of writer w holds BATCH rollouts with version = b.
# Writers share the even batches (same content, same record ids) and own the odd ones.
CHILD = r"""
import json, sys
from mutualrl.exchange import open_exchange
from mutualrl.experience import Rollout

url, writer, start, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def make(b):
    owner = "shared" if b % 2 == 0 else writer
    return [Rollout(f"p{b}", "prompt", f"c{k}", owner, "tok", [k, k + 1], [-0.5, -0.25], 1.0, b,
                    sample_index=k) for k in range(batch)]

ex = open_exchange(url)
acc = dup = 0
for b in range(start, start + n):
    res = ex.publish(make(b))
    acc += res.accepted
    dup += res.duplicates
    print(f"ack {b}", flush=True)
print(json.dumps({"accepted": acc, "duplicates": dup}), flush=True)
"""


def _spawn(url: str, writer: str, start: int, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, url, writer, str(start), str(n), str(BATCH)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _versions(path: Path) -> dict[int, int]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT version, COUNT(*) FROM experience GROUP BY version").fetchall())
    finally:
        conn.close()


def test_two_writer_processes_and_a_reader(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/see.db"
    open_exchange(url).close()
    n = 80
    procs = [_spawn(url, "w1", 0, n), _spawn(url, "w2", 0, n)]
    reader = open_exchange(url)
    seen_partial = []
    while any(p.poll() is None for p in procs):  # readers only ever see whole batches
        counts = reader.query([f"p{b}" for b in range(n)])
        per_batch: dict[tuple[int, str], int] = {}
        for r in counts:
            per_batch[(r.version, r.source_policy)] = per_batch.get((r.version, r.source_policy), 0) + 1
        seen_partial += [k for k, c in per_batch.items() if c != BATCH]
        time.sleep(0.01)
    results = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert not seen_partial
    shared, own = n // 2, n // 2  # even batches are shared by both writers, odd ones are per writer
    union = (shared + 2 * own) * BATCH
    assert sum(r["accepted"] for r in results) == union
    assert sum(r["duplicates"] for r in results) == shared * BATCH
    st = reader.stats()
    assert st["rows"] == union and st["max_seq"] >= union
    assert len({r.record_id for r in reader.query([f"p{b}" for b in range(n)])}) == union
    reader.close()


def test_kill_9_mid_stream_keeps_every_acknowledged_batch_once(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    url = f"sqlite:///{path}"
    proc = _spawn(url, "w", 0, 100_000)
    acked: list[int] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while len(acked) < 25 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked.append(int(line.split()[1]))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(acked) >= 25, proc.stderr.read() if proc.stderr else ""

    counts = _versions(path)
    assert all(c == BATCH for c in counts.values()), counts  # every batch is all-or-nothing
    assert set(acked) <= set(counts)  # every acknowledged batch survived
    assert sorted(counts) == list(range(len(counts)))  # a gap-free prefix of the stream
    with open_exchange(url) as ex:
        st = ex.stats()
        assert st["rows"] == BATCH * len(counts)
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT COUNT(DISTINCT record_id) FROM experience").fetchone()[0] == st["rows"]
        conn.close()
    # Republishing everything (as a restarted writer would) adds nothing twice.
    again = _spawn(url, "w", 0, max(counts) + 1)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["accepted"] == 0
    assert _versions(path) == counts
