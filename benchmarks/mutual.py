"""Mutual training on the embedded default: every arm on the same seeds, steps and prompts.

    python benchmarks/mutual.py [--quick] [--seeds 0,1,2] [--steps N] [--arms ...]

Writes benchmarks/results/mutual.json (or mutual_quick.json with --quick) with, per arm, the
average held-out accuracy at the end (mean and std over seeds), the best, per-policy finals and
wall time, plus the report (table + curves) under benchmarks/results/mutual_report/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, git_rev, machine, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--arms", default="independent,prp,xgrpo,sgt")
    ap.add_argument("--out", default="runs/bench_mutual")
    ap.add_argument("--name", default=None, help="result name (default mutual / mutual_quick)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (each in its own process, "
                    "torch threads = cores / jobs)")
    ap.add_argument("--one", nargs=3, metavar=("ARM", "SEED", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help="keep runs that already finished in --out")
    ap.add_argument("--set", default=None, help="JSON merged into the demo config (e.g. sharing options)")
    args = ap.parse_args()
    if args.one:
        _run_one(args)
        return

    from mutualrl.demo import DEMO_POLICIES
    from mutualrl.report import load_run, summarize, write_report
    from mutualrl.zoo import build_zoo

    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    out = Path(args.out) / ("quick" if args.quick else "full")
    t0 = time.perf_counter()
    build_zoo(DEMO_POLICIES, seed=0, progress=False)
    run_dirs, wall = [], {a: [] for a in arms}
    jobs = [(arm, seed, out / f"{arm}-seed{seed}") for seed in seeds for arm in arms]  # arms alternate
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    running: list = []
    for arm, seed, d in jobs:
        if args.reuse and (d / "summary.json").is_file():
            running.append((arm, seed, d, time.perf_counter(), subprocess.Popen(["true"])))
            continue
        if d.exists():
            shutil.rmtree(d)
        cmd = [sys.executable, __file__, "--one", arm, str(seed), str(d)]
        if args.quick:
            cmd.append("--quick")
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.set:
            cmd += ["--set", args.set]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        running.append((arm, seed, d, time.perf_counter(), subprocess.Popen(cmd, env=env)))
        while len([r for r in running if r[4].poll() is None]) >= args.jobs:
            time.sleep(1)
    for arm, seed, d, t, proc in running:
        if proc.wait() != 0:
            raise SystemExit(f"run {arm} seed {seed} failed (exit {proc.returncode})")
        wall[arm].append(json.loads((d / "summary.json").read_text())["wall_s"])
        run_dirs.append(d)
        print(f"done {arm} seed {seed} in {wall[arm][-1]:.0f}s", file=sys.stderr)
    runs = [load_run(d) for d in run_dirs]
    summ = summarize(runs)
    name = args.name or ("mutual_quick" if args.quick else "mutual")
    write_report(run_dirs, RESULTS / f"{name}_report", title=f"mutualrl {name}")
    base = summ.get("independent", {}).get("avg_test_acc_final", {}).get("mean")
    print(f"\n{'arm':<14}{'final avg acc':>16}{'std':>8}{'best':>8}{'Δ vs indep':>12}{'wall s':>9}")
    for arm in arms:
        s = summ.get(arm)
        if not s:
            continue
        f = s["avg_test_acc_final"]
        s["wall_s"] = statistics.fmean(wall[arm])
        d = f"{100 * (f['mean'] - base):+.1f}" if base is not None else "n/a"
        print(f"{arm:<14}{f['mean']:>16.3f}{f['std']:>8.3f}{s['avg_test_acc_best']['mean']:>8.3f}{d:>12}"
              f"{s['wall_s']:>9.0f}")
    cfg0 = _config("independent", 0, args)
    write_result(name, {
        "policies": DEMO_POLICIES, "tasks": ["basic_arithmetic:add", "basic_arithmetic:sub"],
        "seeds": seeds, "steps": cfg0["steps"], "config": cfg0, "arms": summ,
        "targets": {"sgt_minus_independent_pts": 10, "xgrpo_minus_independent_pts": 0,
                    "prp_minus_independent_pts": -2},
        "deltas_pts": {a: 100 * (summ[a]["avg_test_acc_final"]["mean"] - base) for a in summ} if base is not None
        else {},
        "machine": machine(), "quick": args.quick, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


def _config(arm: str, seed: int, args: argparse.Namespace) -> dict:
    from mutualrl.demo import demo_config

    cfg = demo_config(arm, seed, quick=args.quick, steps=args.steps)
    for k, v in (json.loads(args.set) if args.set else {}).items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    return cfg


def _run_one(args: argparse.Namespace) -> None:
    import torch

    from mutualrl.config import load_config
    from mutualrl.trainer import MutualTrainer

    arm, seed, d = args.one
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    MutualTrainer(load_config(_config(arm, int(seed), args)), Path(d), progress=False).train()


if __name__ == "__main__":
    main()
