"""SEE benchmark: publish throughput and per-step query latency of the exchange backends.

Simulates a mutual-training history: every step, two policies (A, B) each publish, for 64
prompts, 8 rollouts (``--tokens`` tokens each), one group outcome and a verified success for
about half the prompts, in batches of 256 records. The store is filled up to ``rows`` rollouts.
Then the *per-step query* is timed: the 64 prompt ids of a past step, all kinds, excluding the
learner's own rows (``exclude_source="A"``), i.e. what a learner pulls from its peer each step.

The same is measured at ``rows`` and at ``rows / 10`` to show how the cost grows with the store,
for ``sqlite://`` (the embedded default) and ``ray://`` (an actor holding a SQLite store).

    python benchmarks/exchange.py            # 100,000 and 10,000 rollouts
    python benchmarks/exchange.py --quick    # 20,000 and 2,000 rollouts

Writes ``benchmarks/results/exchange.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mutualrl.exchange import open_exchange
from mutualrl.experience import GroupOutcome, Record, Rollout, VerifiedSuccess

PROMPTS_PER_STEP = 64
GROUP = 8
POLICIES = ("A", "B")
DATASET = 8192  # distinct prompt ids (a MATH-sized train split)
BATCH = 256
SEED = 0


_POOL: dict[int, list[tuple[list[int], list[float]]]] = {}


def _pool(tokens: int) -> list[tuple[list[int], list[float]]]:
    """512 random (token ids, logprobs) traces, drawn once (drawing per rollout would dominate)."""
    if tokens not in _POOL:
        rng = random.Random(SEED)
        _POOL[tokens] = [([rng.randrange(50_000) for _ in range(tokens)],
                          [-rng.random() * 3 for _ in range(tokens)]) for _ in range(512)]
    return _POOL[tokens]


def step_records(step: int, tokens: int, rng: random.Random) -> list[Record]:
    """All records the two policies publish in one training step."""
    out: list[Record] = []
    pool = _pool(tokens)
    pids = [f"q{(step * PROMPTS_PER_STEP + i) % DATASET}" for i in range(PROMPTS_PER_STEP)]
    for pol in POLICIES:
        for pid in pids:
            prompt = f"Problem {pid}: compute the value of the expression " + "x" * 120
            rewards = []
            for k in range(GROUP):
                ids, lps = pool[rng.randrange(len(pool))]
                reward = float(rng.random() < 0.3)
                rewards.append(reward)
                out.append(Rollout(pid, prompt, "step " * (tokens // 2) + f"answer {k}", pol, f"tok-{pol}",
                                   ids, lps, reward, step, sample_index=k))
            out.append(GroupOutcome.from_rewards(pid, pol, rewards, step))
            if max(rewards) > 0:
                out.append(VerifiedSuccess(pid, "answer", pol, "exact_match", 1.0, step))
    return out


def fill(ex: Any, start_step: int, target_rollouts: int, have: int, tokens: int,
         rng: random.Random) -> tuple[int, int, int, float, float]:
    """Publish steps until ``target_rollouts`` rollouts are stored.

    Returns (next step, rollouts stored, records published, wall seconds and CPU seconds of
    this process spent inside publish).
    """
    step, published, spent, cpu = start_step, 0, 0.0, 0.0
    while have < target_rollouts:
        recs = step_records(step, tokens, rng)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(recs), BATCH):
            res = ex.publish(recs[i:i + BATCH])
            assert res.accepted == len(recs[i:i + BATCH]), res
        spent += time.perf_counter() - t0
        cpu += time.process_time() - c0
        published += len(recs)
        have += sum(1 for r in recs if r.kind == "rollout")
        step += 1
    return step, have, published, spent, cpu


def time_queries(ex: Any, steps: int, n: int, rng: random.Random) -> tuple[list[float], list[float], float]:
    """Time ``n`` per-step queries on random past steps.

    Returns (wall latencies in ms, this process's CPU ms per query, mean rows returned).
    """
    lat, cpu, sizes = [], [], []
    for _ in range(n):
        s = rng.randrange(steps)
        pids = [f"q{(s * PROMPTS_PER_STEP + i) % DATASET}" for i in range(PROMPTS_PER_STEP)]
        t0, c0 = time.perf_counter(), time.process_time()
        rows = ex.query(pids, exclude_source="A")
        lat.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        sizes.append(len(rows))
    return lat, cpu, statistics.fmean(sizes)


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(url: str, rows: int, tokens: int, queries: int) -> dict[str, Any]:
    """Fill a fresh store to ``rows`` rollouts and time publish and the per-step query."""
    rng = random.Random(SEED)
    ex = open_exchange(url)
    try:
        steps, have, published, spent, cpu = fill(ex, 0, rows, 0, tokens, rng)
        ex.query([f"q{i}" for i in range(PROMPTS_PER_STEP)], exclude_source="A")  # warm-up
        lat, qcpu, mean_rows = time_queries(ex, steps, queries, rng)
        stats = ex.stats()
    finally:
        destroy = getattr(ex, "destroy", None)
        if destroy is not None:
            destroy()
        ex.close()
    return {
        "rows": have,
        "records_total": stats["rows"],
        "publish_rows_per_s": published / spent,
        "query_p50_ms": pct(lat, 0.5),
        "query_p99_ms": pct(lat, 0.99),
        "query_rows_returned": mean_rows,
        # CPU time of this process (for ray:// most work is in the actor, so these undercount)
        "publish_rows_per_cpu_s": published / cpu if cpu > 0 else None,
        "query_cpu_p50_ms": pct(qcpu, 0.5),
        "query_cpu_p99_ms": pct(qcpu, 0.99),
    }


def cpu_calibration_us() -> float:
    """Best-of-7 time of ``sum(range(1000))`` in µs: ~10 on an idle modern core. These machines
    are shared, so this says how much CPU the run actually got."""
    import timeit

    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=7)) / 2000 * 1e6


def machine() -> dict[str, Any]:
    """CPU count, torch threads, python and torch versions, load and a CPU-speed calibration."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "loadavg_end": list(os.getloadavg()),
                            "cpu_calibration_us": cpu_calibration_us()}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        info.update(torch=None, torch_threads=None)
    try:
        import sqlite3

        info["sqlite"] = sqlite3.sqlite_version
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = None
    return info


def git_rev() -> str | None:
    """The current commit, or None outside a checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20k/2k rollouts instead of 100k/10k")
    ap.add_argument("--rows", type=int, default=None, help="rollouts stored at the large size")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rollout")
    ap.add_argument("--queries", type=int, default=300, help="timed queries per measurement")
    ap.add_argument("--no-ray", action="store_true", help="skip the ray:// backend")
    ap.add_argument("--out", default="benchmarks/results/exchange.json")
    args = ap.parse_args(argv)
    rows = args.rows or (20_000 if args.quick else 100_000)
    t_start = time.perf_counter()
    calib_start, load_start = cpu_calibration_us(), list(os.getloadavg())

    ray_ok = not args.no_ray
    if ray_ok:
        try:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        except ImportError:
            ray_ok = False

    result: dict[str, Any] = {"by_rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (rows, rows // 10):
            entry: dict[str, Any] = {"rows_target": n}
            entry["sqlite"] = measure(f"sqlite:///{tmp}/see-{n}.db", n, args.tokens, args.queries)
            if ray_ok:
                url = f"ray://bench-{n}?store=sqlite:///{tmp}/ray-{n}.db"
                entry["ray"] = measure(url, n, args.tokens, args.queries)
            result["by_rows"].append(entry)
    if ray_ok:
        import ray

        ray.shutdown()

    big, small = result["by_rows"]
    flat = lambda e: {
        "rows": e["sqlite"]["rows"],
        "publish_rows_per_s": e["sqlite"]["publish_rows_per_s"],
        "query_p50_ms": e["sqlite"]["query_p50_ms"],
        "query_p99_ms": e["sqlite"]["query_p99_ms"],
        "publish_rows_per_cpu_s": e["sqlite"]["publish_rows_per_cpu_s"],
        "query_cpu_p50_ms": e["sqlite"]["query_cpu_p50_ms"],
        "query_cpu_p99_ms": e["sqlite"]["query_cpu_p99_ms"],
        "ray_publish_rows_per_s": e["ray"]["publish_rows_per_s"] if "ray" in e else None,
        "ray_query_p99_ms": e["ray"]["query_p99_ms"] if "ray" in e else None,
    }
    out: dict[str, Any] = {**flat(big), "small": flat(small), "by_rows": result["by_rows"]}
    out["query_growth_p50"] = big["sqlite"]["query_p50_ms"] / small["sqlite"]["query_p50_ms"]
    out["query_growth_p99"] = big["sqlite"]["query_p99_ms"] / small["sqlite"]["query_p99_ms"]
    out["setup"] = {"tokens_per_rollout": args.tokens, "prompts_per_query": PROMPTS_PER_STEP,
                    "group_size": GROUP, "policies": list(POLICIES), "batch": BATCH,
                    "dataset_prompts": DATASET, "queries": args.queries, "seed": SEED,
                    "sqlite_synchronous": "normal"}
    out["targets"] = {"publish_rows_per_s": ">= 20000", "query_p99_ms": "<= 20", "query_growth": "<= 2"}
    out["machine"] = {**machine(), "loadavg_start": load_start, "cpu_calibration_us_start": calib_start}
    out["quick"] = bool(args.quick)
    out["wall_s"] = time.perf_counter() - t_start
    out["git_rev"] = git_rev()

    print(f"{'backend':8} {'rollouts':>9} {'publish rows/s':>15} {'(per CPU-s)':>12} {'query p50 ms':>13}"
          f" {'query p99 ms':>13} {'(CPU p99)':>10} {'rows/query':>11}")
    for e in result["by_rows"]:
        for be in ("sqlite", "ray"):
            if be in e:
                m = e[be]
                print(f"{be:8} {m['rows']:>9,} {m['publish_rows_per_s']:>15,.0f} {m['publish_rows_per_cpu_s']:>12,.0f}"
                      f" {m['query_p50_ms']:>13.2f} {m['query_p99_ms']:>13.2f} {m['query_cpu_p99_ms']:>10.2f}"
                      f" {m['query_rows_returned']:>11.0f}")
    print(f"CPU calibration (sum(range(1000)), ~10 us on an idle core): {calib_start:.0f} us at start, "
          f"{out['machine']['cpu_calibration_us']:.0f} us at end; load {load_start[0]:.1f} -> "
          f"{out['machine']['loadavg_end'][0]:.1f}")
    print(f"sqlite query growth {small['sqlite']['rows']:,} -> {big['sqlite']['rows']:,} rollouts: "
          f"p50 x{out['query_growth_p50']:.2f}, p99 x{out['query_growth_p99']:.2f}; wall {out['wall_s']:.0f}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
