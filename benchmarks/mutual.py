"""Mutual training on the embedded default: every arm on the same seeds, steps, prompts and budget.

    python benchmarks/mutual.py [--quick] [--seeds 0,1,2] [--steps N] [--arms ...] [--jobs 2] [--reuse] [--zoo-seed N]

Every arm runs the demo's config (the two shipped zoo policies, the zoo task, 64 prompts x 8
samples per step) with only ``sharing.strategy`` changed, so steps, prompts and the rollout budget
are equal: the paper's probes (``prp``, ``xgrpo``, ``sgt``, ``xgrpo+sgt``), the new steps
(``guide``, ``imitate``), the control ``self_imitate`` (imitate's own-success rows alone: what
self-imitation gives without a peer), and the **efficiency arm** in HACPO's sense
(``imitate+prp`` with 4 own samples per prompt instead of 8: each group is filled with 4 of the
peer's rollouts, re-scored by the learner; half the own rollout budget). Writes
``benchmarks/results/mutual.json`` (``mutual_quick.json`` with ``--quick``): per arm, the average
held-out accuracy initial/final/best with every seed's value (``avg_test_acc_final.values``),
``avg_gain_pts``, per policy and per skill, the peer rows used per step (``rows_used_per_step``),
SGT/imitate rescue rows, wall time; the deltas against ``independent``; the targets of the sharing
issue and whether each is met; the report (table, what sharing did, curves) under
``benchmarks/results/mutual_report/``. Runs go ``--jobs`` at a time in their own processes (torch
threads = cores / jobs).
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, git_rev, machine, write_result

ARMS: dict[str, dict[str, Any]] = {
    "independent": {},
    "prp": {},
    "xgrpo": {},
    "sgt": {},
    "xgrpo+sgt": {},
    "guide": {},
    "imitate": {},
    "self_imitate": {},
    "imitate+prp": {"grpo": {"num_generations": 4}, "sharing": {"prp": {"max_per_prompt": 4}}},
}
"""Arm (its strategy) -> config overrides on top of the demo's. ``imitate+prp`` is the efficiency arm."""
EFFICIENCY_ARM = "imitate+prp"
BEST_ARM = "imitate"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/bench_mutual")
    ap.add_argument("--name", default=None, help="result name (default mutual / mutual_quick)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (each in its own process, "
                    "torch threads = cores / jobs)")
    ap.add_argument("--one", nargs=3, metavar=("ARM", "SEED", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help="keep runs that already finished in --out and resume "
                    "interrupted ones from their last checkpoint")
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--set", default=None, help="JSON merged into every arm's config (e.g. sharing options)")
    ap.add_argument("--target-gap", type=float, default=5.0, help="points the best arm must gain over independent")
    ap.add_argument("--task-file", default=None, help="a `zoo build --task` file: train its policies on its task "
                    "instead of the shipped zoo on add + sub (benchmarks/mutual_taskmix.py)")
    ap.add_argument("--zoo-seed", type=int, default=0, help="the zoo build seed of the policies (default 0: the "
                    "shipped ones, or the task file's seed-0 build); another seed is built first if not cached")
    args = ap.parse_args()
    if args.set:
        try:
            given = json.loads(args.set)
        except ValueError as exc:
            given = exc
        if not isinstance(given, dict):
            ap.error(f"--set {args.set!r}: give a JSON object of config sections, e.g. "
                     f"'{{\"sharing\": {{\"sgt_learning_rate\": 7.5e-5}}}}' "
                     f"({given if isinstance(given, ValueError) else 'not an object'})")
    if args.one:
        _run_one(args)
        return

    from mutualrl.checkpoint import latest_checkpoint
    from mutualrl.demo import DEMO_POLICIES
    from mutualrl.report import load_run, summarize, write_report
    from mutualrl.zoo import build_zoo

    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    out = Path(args.out) / ("quick" if args.quick else "full")
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    if args.task_file:
        policies, task = task_file_policies(args.task_file, args.zoo_seed)
    else:
        build_zoo(DEMO_POLICIES, seed=args.zoo_seed, progress=False)
        policies, task = DEMO_POLICIES, ["basic_arithmetic:add", "basic_arithmetic:sub"]
    run_dirs, wall = [], {a: [] for a in arms}
    jobs = [(arm, seed, out / f"{arm}-seed{seed}") for seed in seeds for arm in arms]  # arms alternate
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    running: list = []
    resumed: list[str] = []
    reused: list[str] = []
    for arm, seed, d in jobs:
        if args.reuse and (d / "summary.json").is_file():
            reused.append(f"{arm}-seed{seed}")
            running.append((arm, seed, d, time.perf_counter(), subprocess.Popen(["true"])))
            continue
        resume = args.reuse and d.is_dir() and latest_checkpoint(d) is not None
        if resume:
            resumed.append(f"{arm}-seed{seed}")
        elif d.exists():
            shutil.rmtree(d)
        cmd = [sys.executable, __file__, "--one", arm, str(seed), str(d)] + (["--resume"] if resume else [])
        if args.quick:
            cmd.append("--quick")
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        if args.set:
            cmd += ["--set", args.set]
        if args.task_file:
            cmd += ["--task-file", args.task_file]
        if args.zoo_seed:
            cmd += ["--zoo-seed", str(args.zoo_seed)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        running.append((arm, seed, d, time.perf_counter(), subprocess.Popen(cmd, env=env)))
        while len([r for r in running if r[4].poll() is None]) >= args.jobs:
            time.sleep(1)
    for arm, seed, d, _, proc in running:
        if proc.wait() != 0:
            raise SystemExit(f"run {arm} seed {seed} failed (exit {proc.returncode})")
        wall[arm].append(json.loads((d / "summary.json").read_text())["wall_s"])
        run_dirs.append(d)
        print(f"done {arm} seed {seed} in {wall[arm][-1]:.0f}s", file=sys.stderr)
    runs = [load_run(d) for d in run_dirs]
    summ = summarize(runs)
    name = args.name or ("mutual_quick" if args.quick else "mutual")
    cfg0 = _config("independent", 0, args)
    write_report(run_dirs, RESULTS / f"{name}_report", title=f"mutualrl {name}",
                 notes=[(f"Config: {cfg0['prompts_per_step']} prompts x {cfg0['grpo']['num_generations']} samples "
                         f"per step, lr {cfg0['grpo']['learning_rate']}, reward {cfg0['task'].get('reward', 'score')}; "
                         f"the efficiency arm {EFFICIENCY_ARM} samples 4 per prompt and fills the group from peers; "
                         "self_imitate is the control of imitate (its own-success rows, no peer).")])
    base = summ.get("independent", {}).get("avg_test_acc_final", {}).get("mean")
    print(f"\n{'arm':<14}{'final avg acc':>16}{'std':>8}{'gain pts':>10}{'min gain':>10}{'Δ vs indep':>12}"
          f"{'rows/step':>11}{'wall s':>9}")
    for arm in arms:
        s = summ.get(arm)
        if not s:
            continue
        f = s["avg_test_acc_final"]
        s["wall_s"] = statistics.fmean(wall[arm])
        rows = s.get("rows_used_per_step", {})
        s["rows_used_per_step_mean"] = statistics.fmean(v["mean"] for v in rows.values()) if rows else 0.0
        d = f"{100 * (f['mean'] - base):+.1f}" if base is not None else "n/a"
        print(f"{arm:<14}{f['mean']:>16.3f}{f['std']:>8.3f}{s['avg_gain_pts']['mean']:>+10.1f}"
              f"{s['avg_gain_pts']['min']:>+10.1f}{d:>12}{s['rows_used_per_step_mean']:>11.1f}{s['wall_s']:>9.0f}")
    mach = machine()
    mach["load_avg"] = {"start": load_start, "end": os.getloadavg()[0]}
    write_result(name, {
        "policies": policies, "tasks": task, "task_file": args.task_file, "zoo_seed": args.zoo_seed,
        "seeds": seeds, "steps": cfg0["steps"], "prompts_per_step": cfg0["prompts_per_step"],
        "num_generations": cfg0["grpo"]["num_generations"], "eval_size": cfg0["eval_size"], "config": cfg0,
        "arm_overrides": {a: ARMS.get(a, {}) for a in arms}, "set": _set_overrides(args) or None,
        "best_arm": BEST_ARM, "efficiency_arm": EFFICIENCY_ARM,
        "arms": summ,
        "deltas_pts": {a: 100 * (summ[a]["avg_test_acc_final"]["mean"] - base) for a in summ} if base is not None
        else {},
        "targets": targets(summ, args.target_gap),
        "resumed_runs": resumed,  # finished from their last checkpoint after an interruption (wall_s: the last part)
        "reused_runs": reused,  # finished before this invocation (--reuse): machine.load_avg is not theirs
        "machine": mach, "jobs": args.jobs, "quick": args.quick, "wall_s": time.perf_counter() - t0,
        "git_rev": git_rev(),
    })


def targets(summ: dict[str, Any], target_gap: float = 5.0) -> dict[str, Any]:
    """The sharing issue's figures for the zoo, measured: the best arm >= independent + 5 points on the
    mean and above it on every seed, no policy's own skill more than 2 points below independent's;
    the efficiency arm >= independent's full-budget mean; and the best arm against the control
    ``self_imitate`` (the same supervised step on the learner's own successes alone), per seed."""
    ind, best, eff = summ.get("independent"), summ.get(BEST_ARM), summ.get(EFFICIENCY_ARM)
    out: dict[str, Any] = {}
    if ind and best:
        gap = 100 * (best["avg_test_acc_final"]["mean"] - ind["avg_test_acc_final"]["mean"])
        per_seed = [100 * (b - i) for b, i in zip(best["avg_test_acc_final"]["values"],
                                                   ind["avg_test_acc_final"]["values"], strict=True)]
        own_cost = {}
        for p, skills in ind["per_policy_skill_initial"].items():
            own = max(skills, key=lambda k: skills[k]["mean"])
            own_cost[p] = 100 * (best["per_policy_skill_final"][p][own]["mean"]
                                 - ind["per_policy_skill_final"][p][own]["mean"])
        out["best_minus_independent_pts"] = {"value": gap, "target": target_gap, "met": gap >= target_gap}
        out["best_above_independent_every_seed"] = {"values": per_seed, "met": all(v > 0 for v in per_seed)}
        out["own_skill_cost_pts"] = {"values": own_cost, "target": -2.0,
                                     "met": all(v >= -2.0 for v in own_cost.values())}
    control = summ.get("self_imitate")
    if best and control:  # what the peers add beyond the learner imitating its own successes
        per_seed = [100 * (b - c) for b, c in zip(best["avg_test_acc_final"]["values"],
                                                   control["avg_test_acc_final"]["values"], strict=True)]
        out["best_minus_self_imitate_pts"] = {"value": statistics.fmean(per_seed), "values": per_seed,
                                              "met": all(v > 0 for v in per_seed)}
    if ind and eff:
        gap = 100 * (eff["avg_test_acc_final"]["mean"] - ind["avg_test_acc_final"]["mean"])
        out["efficiency_minus_independent_pts"] = {"value": gap, "target": 0.0, "met": gap >= 0.0,
                                                   "own_samples_per_prompt": 4, "independent_samples_per_prompt": 8}
    return out


def task_file_policies(path: str, zoo_seed: int = 0) -> tuple[list[str], Any]:
    """The policies a ``zoo build --task`` file names (built once per build seed, cached) and its task section."""
    from mutualrl.zoo.build import build_zoo
    from mutualrl.zoo.cli import task_specs

    task, specs, section = task_specs(path)
    dirs = build_zoo(list(specs), seed=zoo_seed, progress=False, specs=specs, task=task, task_section=section)
    return [str(dirs[n]) for n in specs], section


def _set_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--set`` JSON object (checked in :func:`main`), or an empty one."""
    return json.loads(args.set) if args.set else {}


def _config(arm: str, seed: int, args: argparse.Namespace) -> dict:
    from mutualrl.demo import demo_config

    cfg = demo_config(arm, seed, quick=args.quick, steps=args.steps, zoo_seed=args.zoo_seed)
    if args.task_file:
        dirs, section = task_file_policies(args.task_file, args.zoo_seed)
        cfg["policies"] = [{"name": Path(d).name, "model": d} for d in dirs]
        cfg["task"] = {**section, "test_size": cfg["task"]["test_size"], "seed": 0, "reward": "exact"}
    for overrides in (ARMS.get(arm, {}), _set_overrides(args)):
        for k, v in overrides.items():
            if isinstance(v, dict):
                cfg.setdefault(k, {}).update(v)
            else:
                cfg[k] = v
    return cfg


def _run_one(args: argparse.Namespace) -> None:
    import torch

    from mutualrl.resolve import load_config
    from mutualrl.trainer import MutualTrainer

    arm, seed, d = args.one
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    MutualTrainer(load_config(_config(arm, int(seed), args)), Path(d), resume=args.resume, progress=False).train()


if __name__ == "__main__":
    main()
