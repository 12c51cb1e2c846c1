"""Mutual training with the real-small preset: SmolLM2-135M-Instruct + Gemma-3-270M.

    python benchmarks/mutual_real_small.py [--steps N] [--arms independent,sgt] [--minutes M]

Runs each arm on the same seed and prompts from examples/real_small.yaml (scaled by the flags)
and writes benchmarks/results/mutual_real_small.json with the same per-arm keys as mutual.json.
Needs `mutualrl models prepare real-small` (done on demand).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arms", default="independent,prp,xgrpo,sgt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--out", default="runs/bench_real_small")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import shutil

    import yaml

    from mutualrl.config import load_config
    from mutualrl.report import load_run, summarize
    from mutualrl.trainer import MutualTrainer

    base = yaml.safe_load((ROOT / "examples" / "real_small.yaml").read_text())
    arms = [a.strip() for a in args.arms.split(",")]
    t0 = time.perf_counter()
    dirs, wall = [], {}
    for arm in arms:
        d = dict(base)
        d["sharing"] = {**base.get("sharing", {}), "strategy": arm}
        d["grpo"] = {**base["grpo"], "num_generations": args.generations}
        d.update(steps=args.steps, prompts_per_step=args.prompts, eval_size=args.eval_size,
                 eval_every=max(1, args.steps // 2), checkpoint_every=100000, seed=args.seed)
        out = Path(args.out) / arm
        if out.exists():
            shutil.rmtree(out)
        t = time.perf_counter()
        MutualTrainer(load_config(d), out, progress=False).train()
        wall[arm] = time.perf_counter() - t
        dirs.append(out)
        print(f"done {arm} in {wall[arm]:.0f}s", file=sys.stderr)
    summ = summarize([load_run(x) for x in dirs])
    for arm, s in summ.items():
        s["wall_s"] = wall[arm]
        print(f"{arm:<14} final avg acc {s['avg_test_acc_final']['mean']:.3f}  initial "
              f"{s['initial_avg_test_acc']:.3f}  wall {wall[arm]:.0f}s")
    write_result("mutual_real_small", {
        "policies": ["smollm2 (SmolLM2-135M-Instruct)", "gemma3 (Gemma-3-270M)"],
        "tasks": ["basic_arithmetic (2-digit + and -)"], "seeds": [args.seed], "steps": args.steps,
        "prompts_per_step": args.prompts, "num_generations": args.generations, "eval_size": args.eval_size,
        "arms": summ, "machine": machine(), "quick": False, "wall_s": time.perf_counter() - t0,
        "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
