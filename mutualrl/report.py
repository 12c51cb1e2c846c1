"""Comparison report across runs: a table of final/best accuracy per arm and the paper-style figure.

Each run directory is one (strategy, seed). Arms are grouped by ``sharing.strategy``; seeds of
one arm are averaged (mean and std). The figure has two rows (held-out test accuracy, train
reward) and one column per policy plus the average, one line per arm.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

ARM_ORDER = ["independent", "prp", "xgrpo", "sgt"]


def load_run(run_dir: Path) -> dict[str, Any]:
    """Read a run directory: its config, eval rows and per-step rows."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    evals, steps = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if row.get("event") == "eval" else steps).append(row)
    return {"dir": str(run_dir), "strategy": cfg["sharing"]["strategy"], "seed": cfg["seed"],
            "policies": [p["name"] for p in cfg["policies"]], "evals": evals, "steps": steps}


def _series(rows: list[dict[str, Any]], policy: str, key: str) -> tuple[list[int], list[float]]:
    sel = [r for r in rows if (policy == "average" or r["policy"] == policy) and key in r]
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in sel:
        by_step[r["step"]].append(r[key])
    xs = sorted(by_step)
    return xs, [statistics.fmean(by_step[x]) for x in xs]


def _smooth(ys: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(statistics.fmean(acc))
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: final and best average test accuracy (mean/std over seeds) and per-policy finals."""
    arms: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        arms[r["strategy"]].append(r)
    out: dict[str, Any] = {}
    for arm, rs in arms.items():
        finals, bests, per_pol = [], [], defaultdict(list)
        for r in rs:
            xs, avg = _series(r["evals"], "average", "test_acc")
            if not avg:
                continue
            finals.append(avg[-1])
            bests.append(max(avg))
            for p in r["policies"]:
                _, ys = _series(r["evals"], p, "test_acc")
                if ys:
                    per_pol[p].append(ys[-1])
        if not finals:
            continue
        sd = statistics.pstdev(finals) if len(finals) > 1 else 0.0
        out[arm] = {
            "avg_test_acc_final": {"mean": statistics.fmean(finals), "std": sd, "values": finals},
            "avg_test_acc_best": {"mean": statistics.fmean(bests), "values": bests},
            "per_policy_final": {p: {"mean": statistics.fmean(v), "values": v} for p, v in per_pol.items()},
            "seeds": [r["seed"] for r in rs],
            "initial_avg_test_acc": statistics.fmean(
                _series(r["evals"], "average", "test_acc")[1][0] for r in rs if r["evals"]),
        }
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """The paper-style figure: rows test accuracy / train reward, columns policies + average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = runs[0]["policies"] + ["average"]
    arms = sorted({r["strategy"] for r in runs}, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))
    fig, axes = plt.subplots(2, len(policies), figsize=(4 * len(policies), 6.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ai, arm in enumerate(arms):
        rs = [r for r in runs if r["strategy"] == arm]
        for ci, pol in enumerate(policies):
            for row, (key, src, smooth) in enumerate([("test_acc", "evals", False), ("reward_mean", "steps", True)]):
                curves = [_series(r[src], pol, key) for r in rs]
                curves = [c for c in curves if c[0]]
                if not curves:
                    continue
                n = min(len(c[0]) for c in curves)
                xs = curves[0][0][:n]
                ys = [statistics.fmean(c[1][i] for c in curves) for i in range(n)]
                if smooth:
                    ys = _smooth(ys)
                ax = axes[row][ci]
                ax.plot(xs, ys, label=arm, color=colors[ai % len(colors)], lw=1.6)
                if len(curves) > 1 and not smooth:
                    sd = [statistics.pstdev([c[1][i] for c in curves]) for i in range(n)]
                    ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                                    color=colors[ai % len(colors)], alpha=0.15)
    for ci, pol in enumerate(policies):
        axes[0][ci].set_title(pol)
        axes[1][ci].set_xlabel("step")
    axes[0][0].set_ylabel("held-out test accuracy")
    axes[1][0].set_ylabel("train reward (smoothed)")
    axes[0][-1].legend(loc="best", fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dirs: list[Path], out_dir: Path, title: str = "mutualrl comparison") -> Path:
    """Write ``report.md``, ``curves.png`` and ``summary.json`` into ``out_dir``."""
    runs = [load_run(d) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    plot(runs, out_dir / "curves.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    arms = sorted(summary, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))
    policies = runs[0]["policies"]
    lines = [f"# {title}", "", f"Runs: {len(runs)}; seeds per arm: "
             + ", ".join(f"{a}={len(summary[a]['seeds'])}" for a in arms), "",
             "| arm | " + " | ".join(f"{p} final" for p in policies)
             + " | average final (mean ± std) | average best | Δ vs independent |",
             "|---|" + "---|" * (len(policies) + 3)]
    base = summary.get("independent", {}).get("avg_test_acc_final", {}).get("mean")
    for a in arms:
        s = summary[a]
        f = s["avg_test_acc_final"]
        delta = f"{100 * (f['mean'] - base):+.1f} pts" if base is not None else "n/a"
        lines.append(f"| {a} | " + " | ".join(f"{s['per_policy_final'].get(p, {}).get('mean', float('nan')):.3f}"
                                             for p in policies)
                     + f" | {f['mean']:.3f} ± {f['std']:.3f} | {s['avg_test_acc_best']['mean']:.3f} | {delta} |")
    lines += ["", "![curves](curves.png)", "",
              "Test accuracy is greedy exact match on the same held-out problems for every policy; train reward "
              "is the mean verifier score of sampled completions (smoothed over 10 steps).", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
