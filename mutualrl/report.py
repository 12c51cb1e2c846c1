"""Comparison report across runs: per-arm table (overall and per skill) and the paper-style figure.

Each run directory is one (strategy, seed). Arms are grouped by ``sharing.strategy``; seeds of one
arm are averaged (mean and spread). The figure has one column per policy plus the average and
three rows: held-out test accuracy, accuracy on the policy's *weak* skill (the task type it was
worst at in the first evaluation: where transfer from a peer shows) and train reward.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from mutualrl.paths import METRICS, SUMMARY
from mutualrl.resolve import run_config

THL_KEYS = ("prp_thl_non1to1_char_frac", "prp_thl_noncanonical")
"""The per-step THL residual metrics a run logs when it aligns peer rollouts (PRP)."""
ARM_ORDER = ["independent", "prp", "xgrpo", "sgt", "xgrpo+sgt", "prp+sgt", "guide", "self_imitate", "imitate",
             "imitate+prp"]


def load_run(run_dir: Path) -> dict[str, Any]:
    """Read a run directory: its config, eval rows and per-step rows."""
    cfg = run_config(run_dir)
    evals, steps = [], []
    for line in (run_dir / METRICS).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if row.get("event") == "eval" else steps).append(row)
    return {"dir": str(run_dir), "strategy": cfg.sharing.strategy, "seed": cfg.seed,
            "policies": [p.name for p in cfg.policies], "evals": evals, "steps": steps}


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


def skills(run: dict[str, Any]) -> list[str]:
    """The task types a run evaluates (``test_acc/<type>`` keys)."""
    return sorted({k.split("/", 1)[1] for r in run["evals"] for k in r if k.startswith("test_acc/")})


def weak_skill(run: dict[str, Any], policy: str) -> str | None:
    """The task type ``policy`` was worst at in the run's first evaluation."""
    return own_and_weak(run, policy)[1]


def _stat(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "values": values}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, mean/spread over seeds: average test accuracy initial/final/best and gain in points;
    per policy initial/final/best and final per skill; SGT rescue rows used."""
    arms: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        arms[r["strategy"]].append(r)
    out: dict[str, Any] = {}
    for arm, rs in arms.items():
        init, finals, bests, gains = [], [], [], []
        pol: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # policy -> key -> values
        for r in rs:
            _, avg = _series(r["evals"], "average", "test_acc")
            if not avg:
                continue
            init.append(avg[0])
            finals.append(avg[-1])
            bests.append(max(avg))
            gains.append(100 * (avg[-1] - avg[0]))
            for p in r["policies"]:
                _, ys = _series(r["evals"], p, "test_acc")
                if not ys:
                    continue
                pol[p]["initial"].append(ys[0])
                pol[p]["final"].append(ys[-1])
                pol[p]["best"].append(max(ys))
                for sk in skills(r):
                    _, ks = _series(r["evals"], p, f"test_acc/{sk}")
                    if ks:
                        pol[p][f"initial/{sk}"].append(ks[0])
                        pol[p][f"final/{sk}"].append(ks[-1])
                own_steps = [s for s in r["steps"] if s["policy"] == p]
                pol[p]["sgt_rescue_rows"].append(float(sum(s.get("sgt_rescue", 0) for s in own_steps)))
                pol[p]["rows_used_per_step"].append(
                    statistics.fmean(s.get("peer_rows", 0) for s in own_steps) if own_steps else 0.0)
                for key in THL_KEYS:
                    vals = [s[key] for s in own_steps if key in s]
                    if vals:
                        pol[p][key].append(statistics.fmean(vals))
        if not finals:
            continue
        entry: dict[str, Any] = {
            "avg_test_acc_initial": _stat(init), "avg_test_acc_final": _stat(finals),
            "avg_test_acc_best": _stat(bests), "avg_gain_pts": _stat(gains),
            "seeds": [r["seed"] for r in rs],
        }
        for kind in ("initial", "final", "best"):
            entry[f"per_policy_{kind}"] = {p: _stat(v[kind]) for p, v in pol.items()}
        entry["per_policy_skill_initial"] = {p: {k.split("/", 1)[1]: _stat(x) for k, x in v.items()
                                                 if k.startswith("initial/")} for p, v in pol.items()}
        entry["per_policy_skill_final"] = {p: {k.split("/", 1)[1]: _stat(x) for k, x in v.items()
                                               if k.startswith("final/")} for p, v in pol.items()}
        entry["sgt_rescue_rows"] = {p: _stat(v["sgt_rescue_rows"]) for p, v in pol.items()}
        entry["rows_used_per_step"] = {p: _stat(v["rows_used_per_step"]) for p, v in pol.items()}
        entry["thl_residual"] = {p: {k: _stat(v[k]) for k in THL_KEYS if v.get(k)} for p, v in pol.items()}
        out[arm] = entry
    return out


def _order(arms: Any) -> list[str]:
    return sorted(arms, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """The paper-style figure: rows test accuracy / weak-skill accuracy / train reward, columns
    policies + average; one line per arm (mean over seeds, band = spread over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = runs[0]["policies"] + ["average"]
    arms = _order({r["strategy"] for r in runs})
    weak = {p: weak_skill(runs[0], p) for p in runs[0]["policies"]}
    rows = [("test_acc", "evals", False, "held-out test accuracy"),
            ("weak", "evals", False, "accuracy on the weak skill"),
            ("reward_mean", "steps", True, "train reward (smoothed)")]
    fig, axes = plt.subplots(len(rows), len(policies), figsize=(4 * len(policies), 9.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ai, arm in enumerate(arms):
        rs = [r for r in runs if r["strategy"] == arm]
        for ci, pol in enumerate(policies):
            for ri, (key, src, smooth, _) in enumerate(rows):
                if key == "weak":
                    if pol == "average" or weak.get(pol) is None:
                        continue
                    key = f"test_acc/{weak[pol]}"
                curves = [c for c in (_series(r[src], pol, key) for r in rs) if c[0]]
                if not curves:
                    continue
                n = min(len(c[0]) for c in curves)
                xs = curves[0][0][:n]
                ys = [statistics.fmean(c[1][i] for c in curves) for i in range(n)]
                if smooth:
                    ys = _smooth(ys)
                ax = axes[ri][ci]
                ax.plot(xs, ys, label=arm, color=colors[ai % len(colors)], lw=1.6)
                if len(curves) > 1 and not smooth:
                    sd = [statistics.pstdev([c[1][i] for c in curves]) for i in range(n)]
                    ax.fill_between(xs, [y - s for y, s in zip(ys, sd, strict=True)],
                                    [y + s for y, s in zip(ys, sd, strict=True)],
                                    color=colors[ai % len(colors)], alpha=0.15)
    for ci, pol in enumerate(policies):
        axes[0][ci].set_title(pol)
        if weak.get(pol):
            axes[1][ci].set_title(f"{pol}: weak skill '{weak[pol]}'", fontsize=9)
        axes[-1][ci].set_xlabel("step")
    axes[1][-1].axis("off")
    for ri, (_, _, _, label) in enumerate(rows):
        axes[ri][0].set_ylabel(label)
    axes[0][-1].legend(loc="best", fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pm(s: dict[str, Any], scale: float = 1.0, fmt: str = ".3f") -> str:
    """``mean ± std`` over seeds; the mean alone when one seed ran (a spread of one value says nothing)."""
    if len(s.get("values", ())) == 1:
        return f"{scale * s['mean']:{fmt}}"
    return f"{scale * s['mean']:{fmt}} ± {scale * s['std']:{fmt}}"


def own_and_weak(run: dict[str, Any], policy: str) -> tuple[str | None, str | None]:
    """``policy``'s own skill (its best task type at the run's first evaluation) and weak skill (its
    worst). A policy whose types all start equal has no own skill (None): it has nothing to lose."""
    first = [r for r in run["evals"] if r["policy"] == policy]
    if not first:
        return None, None
    r0 = min(first, key=lambda r: r["step"])
    per = {k.split("/", 1)[1]: v for k, v in r0.items() if k.startswith("test_acc/")}
    if len(per) < 2:
        return None, None
    own, weak = max(per, key=per.get), min(per, key=per.get)
    return (None if per[own] == per[weak] else own), weak


def transfer_section(summary: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """What each sharing arm did against independent on the same seeds, per policy and skill: the
    gain on the weak skill (what the peers gave), the cost on the own skill (what it paid), peer rows
    used per step and the THL residual of the rows it aligned."""
    base = summary.get("independent")
    arms = [a for a in _order(summary) if a != "independent"]
    if base is None or not arms:
        return []
    lines = ["", "## What sharing did (against independent, same seeds)", "",
             ("Per policy: the weak skill is its worst task type at step 0 (what a peer can give), the own "
              "skill its best (what sharing may cost); Δ is the arm's final accuracy minus independent's, in "
              "points (mean over seeds; every seed's value in summary.json)."), "",
             "| arm | policy | weak skill Δ (gain) | own skill Δ (cost) | peer rows / step | THL residual |",
             "|---|---|---|---|---|---|"]
    for a in arms:
        s = summary[a]
        for p in runs[0]["policies"]:
            own, weak = own_and_weak(runs[0], p)
            if weak is None:
                continue
            rows = s.get("rows_used_per_step", {}).get(p, {}).get("mean", 0.0)
            thl = s.get("thl_residual", {}).get(p, {})
            res = (f"{100 * thl['prp_thl_non1to1_char_frac']['mean']:.1f} % non-1:1 text, "
                   f"{100 * thl['prp_thl_noncanonical']['mean']:.1f} % non-canonical"
                   if "prp_thl_non1to1_char_frac" in thl and "prp_thl_noncanonical" in thl else "—")
            cost = _skill_delta(s, base, p, own) if own is not None else "— (all types equal at step 0)"
            lines.append(f"| {a} | {p} | {_skill_delta(s, base, p, weak)} | {cost} | "
                         f"{rows:.1f} | {res} |")
    return lines


def _skill_delta(arm: dict[str, Any], base: dict[str, Any], policy: str, skill: str) -> str:
    """``+3.2 (sub)``: the arm's final accuracy on ``skill`` minus the baseline's, in points."""
    a, b = arm["per_policy_skill_final"].get(policy, {}), base["per_policy_skill_final"].get(policy, {})
    if skill not in a or skill not in b:
        return "n/a"
    return f"{100 * (a[skill]['mean'] - b[skill]['mean']):+.1f} ({skill})"


def write_report(run_dirs: list[Path], out_dir: Path, title: str = "mutualrl comparison",
                 notes: list[str] | None = None) -> Path:
    """Write ``report.md``, ``curves.png`` and ``summary.json`` into ``out_dir``."""
    runs = [load_run(d) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    plot(runs, out_dir / "curves.png")
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    arms = _order(summary)
    policies = runs[0]["policies"]
    types = skills(runs[0])
    steps = max((r["step"] for run in runs for r in run["evals"]), default=0)
    lines = [f"# {title}", "", f"{len(runs)} runs, {steps} steps each; seeds per arm: "
             + ", ".join(f"{a} = {len(summary[a]['seeds'])}" for a in arms) + ".", *(notes or []), "",
             "| arm | " + " | ".join(f"{p} final" for p in policies)
             + " | average final (mean ± std) | gain (pts) | Δ vs independent |",
             "|---|" + "---|" * (len(policies) + 3)]
    base = summary.get("independent", {}).get("avg_test_acc_final", {}).get("mean")
    for a in arms:
        s = summary[a]
        f = s["avg_test_acc_final"]
        delta = f"{100 * (f['mean'] - base):+.1f} pts" if base is not None else "n/a"
        lines.append(f"| {a} | " + " | ".join(_pm(s["per_policy_final"][p]) if p in s["per_policy_final"] else "n/a"
                                             for p in policies)
                     + f" | {_pm(f)} | {_pm(s['avg_gain_pts'], fmt='+.1f')} | {delta} |")
    if types:
        lines += ["", "Per skill, final (initial → final, mean over seeds), and SGT rescue rows used per run:", "",
                  "| arm | policy | " + " | ".join(types) + " | rescue rows |", "|---|---|" + "---|" * (len(types) + 1)]
        for a in arms:
            s = summary[a]
            for p in policies:
                ini, fin = s["per_policy_skill_initial"].get(p, {}), s["per_policy_skill_final"].get(p, {})
                cells = [f"{ini[t]['mean']:.3f} → {fin[t]['mean']:.3f}" if t in fin else "n/a" for t in types]
                lines.append(f"| {a} | {p} | " + " | ".join(cells) + f" | {s['sgt_rescue_rows'][p]['mean']:.0f} |")
    lines += transfer_section(summary, runs)
    lines += ["", "![curves](curves.png)", "",
              ("Test accuracy is greedy exact match on the same held-out problems for every policy and arm; the "
               "middle row is each policy's weak skill (its worst task type at step 0); train reward is the mean "
               "reward of sampled completions (smoothed over 10 steps). Bands: spread over seeds."), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
