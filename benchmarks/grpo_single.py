"""One zoo policy, plain GRPO, on the task type where it starts with partial skill.

    python benchmarks/grpo_single.py [--quick] [--steps N] [--lr LR]

Measures held-out greedy accuracy (exact match) before and after training and writes
benchmarks/results/grpo_single.json (keys: policy, task, acc_before, acc_after, steps, wall_s,
plus the common keys). Target: >= +10 points on >= 200 test problems within 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, write_result  # noqa: E402

ADD = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "allow_parentheses": False,
       "allow_negation": False, "operators": ["+"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--policy", default="gpt2-add")
    ap.add_argument("--out", default="runs/bench_grpo_single")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import shutil

    from mutualrl.config import load_config
    from mutualrl.trainer import MutualTrainer

    steps = args.steps or (60 if args.quick else 300)
    test = 200 if args.quick else 500
    cfg = load_config({
        "policies": [{"name": args.policy, "model": f"zoo:{args.policy}"}],
        "task": {"datasets": [{"name": "basic_arithmetic", "alias": "add", "config": ADD}],
                 "test_size": test, "train_size": 8000, "seed": 0},
        "grpo": {"num_generations": 8, "learning_rate": args.lr, "max_completion_length": 6,
                 "loss_type": "dr_grpo", "scale_rewards": "group"},
        "steps": steps, "prompts_per_step": 16, "eval_every": max(1, steps // 6), "eval_size": test,
        "checkpoint_every": 100000, "seed": args.seed,
    })
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    summary = MutualTrainer(cfg, out, progress=False).train()
    wall = time.perf_counter() - t0
    s = summary["policies"][args.policy]
    gain = 100 * (s["test_acc_final"] - s["test_acc_initial"])
    print(f"{'policy':<12}{'task':<24}{'acc before':>12}{'acc after':>11}{'best':>8}{'gain pts':>10}{'steps':>7}"
          f"{'wall s':>8}")
    print(f"{args.policy:<12}{'basic_arithmetic (+)':<24}{s['test_acc_initial']:>12.3f}{s['test_acc_final']:>11.3f}"
          f"{s['test_acc_best']:>8.3f}{gain:>+10.1f}{steps:>7}{wall:>8.0f}")
    write_result("grpo_single" + ("_quick" if args.quick else ""), {
        "policy": args.policy, "task": "basic_arithmetic (2-digit addition)", "acc_before": s["test_acc_initial"],
        "acc_after": s["test_acc_final"], "acc_best": s["test_acc_best"], "gain_pts": gain, "steps": steps,
        "test_problems": test, "learning_rate": args.lr, "seed": args.seed,
        "target": {"gain_pts": 10, "wall_s": 600}, "machine": machine(), "quick": args.quick, "wall_s": wall,
        "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
