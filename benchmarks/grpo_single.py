"""Plain GRPO lifts every default zoo policy: one policy at a time, on its own task mix, 3 seeds.

    python benchmarks/grpo_single.py [--quick] [--seeds 0,1,2] [--steps N] [--policies ...]

Each default zoo policy is trained alone (strategy ``independent``) with the demo's GRPO settings
on its own task mix (the skill mixture it was warm-started on, e.g. 80 % addition and 20 %
subtraction for ``gpt2-add``), from the same warm start (zoo build seed 0) for every run seed.
Held-out greedy exact accuracy on ``--eval-size`` problems of that mix (the same problems for every
seed) before and after. Runs go one at a time, alone on the machine, with all its cores, so
``wall_s`` is what one run costs on it.

Writes ``benchmarks/results/grpo_single.json`` (``grpo_single_quick.json`` with ``--quick``): per
policy ``acc_before``, ``acc_after`` (one per seed), ``gain_pts_mean``, ``gain_pts_min``, per-skill
before/after, ``steps``, ``wall_s`` (per run), plus the common keys. Targets: for every policy
``gain_pts_mean >= 10`` and ``gain_pts_min >= 5``, each run within 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from _common import git_rev, machine, write_result


def run_config(policy: str, seed: int, steps: int, eval_size: int, eval_every: int) -> dict:
    """The demo's GRPO settings for ``policy`` alone on its own task mix."""
    from mutualrl.demo import demo_config
    from mutualrl.zoo import ZOO
    from mutualrl.zoo.task import task_section

    cfg = demo_config("independent", seed, steps=steps)
    t = {k: v for k, v in cfg["task"].items() if k != "preset"}
    cfg.update(policies=[{"name": policy, "model": f"zoo:{policy}"}], task=task_section(ZOO[policy].sft_mixture, **t),
               eval_size=eval_size, eval_every=eval_every, checkpoint_every=10**6)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--policies", default=None, help="default: the zoo's default policies")
    ap.add_argument("--eval-size", type=int, default=None)
    ap.add_argument("--out", default="runs/bench_grpo_single")
    args = ap.parse_args()

    import torch

    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer
    from mutualrl.study.report import load_run
    from mutualrl.zoo import DEFAULT_NAMES, ZOO, build_zoo

    policies = args.policies.split(",") if args.policies else list(DEFAULT_NAMES)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    steps = args.steps or (60 if args.quick else 300)
    eval_size = args.eval_size or (400 if args.quick else 1000)
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    build_zoo(policies, seed=0, progress=False)
    out: dict[str, dict] = {}
    for pol in policies:
        entry: dict = {"acc_before": [], "acc_after": [], "skills_before": [], "skills_after": [], "wall_s": [],
                       "curves": []}
        for seed in seeds:
            d = Path(args.out) / ("quick" if args.quick else "full") / f"{pol}-seed{seed}"
            if d.exists():
                shutil.rmtree(d)
            cfg = load_config(run_config(pol, seed, steps, eval_size, max(1, steps // 6)))
            t = time.perf_counter()
            MutualTrainer(cfg, d, progress=False).train()
            wall = time.perf_counter() - t
            evals = sorted(load_run(d)["evals"], key=lambda r: r["step"])
            first, last = evals[0], evals[-1]
            entry["acc_before"].append(first["test_acc"])
            entry["acc_after"].append(last["test_acc"])
            entry["skills_before"].append({k[9:]: v for k, v in first.items() if k.startswith("test_acc/")})
            entry["skills_after"].append({k[9:]: v for k, v in last.items() if k.startswith("test_acc/")})
            entry["curves"].append([[r["step"], r["test_acc"]] for r in evals])
            entry["wall_s"].append(wall)
            print(f"{pol:<10} seed {seed}: {first['test_acc']:.3f} -> {last['test_acc']:.3f} "
                  f"({100 * (last['test_acc'] - first['test_acc']):+.1f} pts) in {wall:.0f}s", flush=True)
        gains = [100 * (a - b) for a, b in zip(entry["acc_after"], entry["acc_before"], strict=True)]
        entry.update(gain_pts=gains, gain_pts_mean=statistics.fmean(gains), gain_pts_min=min(gains),
                     gain_pts_std=statistics.pstdev(gains) if len(gains) > 1 else 0.0, steps=steps,
                     task_mix=dict(ZOO[pol].sft_mixture))
        out[pol] = entry
    print(f"\n{'policy':<12}{'before':>9}{'after (mean)':>14}{'gain mean':>11}{'gain min':>10}{'wall s/run':>12}")
    for pol, e in out.items():
        print(f"{pol:<12}{statistics.fmean(e['acc_before']):>9.3f}{statistics.fmean(e['acc_after']):>14.3f}"
              f"{e['gain_pts_mean']:>+11.1f}{e['gain_pts_min']:>+10.1f}{statistics.fmean(e['wall_s']):>12.0f}")
    mach = machine()
    mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
    write_result("grpo_single" + ("_quick" if args.quick else ""), {
        "policies": out, "seeds": seeds, "steps": steps, "eval_size": eval_size,
        "config": run_config(policies[0], seeds[0], steps, eval_size, max(1, steps // 6)),
        "targets": {"gain_pts_mean": 10, "gain_pts_min": 5, "wall_s_per_run": 600},
        "machine": mach, "quick": args.quick, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
