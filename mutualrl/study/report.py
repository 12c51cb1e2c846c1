"""Comparison report across runs: the peers' share, a per-arm table (overall and per skill, with the
compute each arm spent) and the paper-style figure.

Each run directory is one (arm, seed): the arm is the label in its ``arm.json`` (what a study or
the demo calls it) or else its ``sharing.strategy``; seeds of one arm are averaged (mean and
sample std). An arm whose strategy reads no peer rows is a single-model arm (a baseline); the
report leads with the best sharing arm minus the strongest baseline, both chosen on validation,
measured on test (:mod:`mutualrl.study.evidence`). The figure has one column per policy plus the average
and three rows: held-out accuracy (validation when the runs have a validation split), accuracy on
the policy's *weak* skill (the task type it was worst at in the first evaluation: where transfer
from a peer shows) and train reward.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from mutualrl.algorithms.registry import parse_strategy
from mutualrl.config.resolve import run_config
from mutualrl.paths import METRICS, SUMMARY
from mutualrl.study import evidence

ARM_FILE = "arm.json"
"""A run directory's arm label (``{"arm": "..."}``), written by whoever ran it as one arm of a
comparison (a study, the demo)."""

THL_KEYS = ("prp_thl_non1to1_char_frac", "prp_thl_noncanonical")
"""The per-step THL residual metrics a run logs when it aligns peer rollouts (PRP)."""
ARM_ORDER = ["independent", "prp", "xgrpo", "sgt", "xgrpo+sgt", "prp+sgt", "guide", "self_imitate", "imitate",
             "imitate+prp"]


def load_run(run_dir: Path) -> dict[str, Any]:
    """Read a run directory: its config, arm label, eval rows, per-step rows and wall time."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    evals, steps = [], []
    for line in (run_dir / METRICS).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if row.get("event") == "eval" else steps).append(row)
    arm = cfg.sharing.strategy
    if (run_dir / ARM_FILE).is_file():
        arm = str(json.loads((run_dir / ARM_FILE).read_text())["arm"])
    wall = json.loads((run_dir / SUMMARY).read_text()).get("wall_s") if (run_dir / SUMMARY).is_file() else None
    return {"dir": str(run_dir), "arm": arm, "strategy": cfg.sharing.strategy, "seed": cfg.seed,
            "policies": [p.name for p in cfg.policies], "evals": evals, "steps": steps, "wall_s": wall}


def single_model(run: dict[str, Any]) -> bool:
    """Whether the run's strategy reads no peer row (a single-model arm: a baseline)."""
    return not parse_strategy(run["strategy"]).reads


def curve_key(runs: list[dict[str, Any]]) -> str:
    """The accuracy the curves follow: validation when the runs have a validation split (the test
    split is then read once, at the end), else test."""
    return "val_acc" if any("val_acc" in r for run in runs for r in run["evals"]) else "test_acc"


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
    """The task types a run evaluates (``test_acc/<type>`` / ``val_acc/<type>`` keys)."""
    return sorted({k.split("/", 1)[1] for r in run["evals"] for k in r if k.startswith(("test_acc/", "val_acc/"))})


def weak_skill(run: dict[str, Any], policy: str) -> str | None:
    """The task type ``policy`` was worst at in the run's first evaluation."""
    return own_and_weak(run, policy)[1]


def _stat(values: list[float]) -> dict[str, Any]:
    """Mean, sample std (0 for one value), min and the values."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "values": values}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, mean/spread over seeds: the final average test accuracy (read once, at the end, with a
    validation split) and validation accuracy; the curve's accuracy initial/best and gain in points
    (validation when there is one, else test); per policy and per skill; the compute spent (trained
    tokens, optimizer steps, sampled tokens, wall time per run); peer rows used."""
    arms: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        arms[r["arm"]].append(r)
    key = curve_key(runs)
    out: dict[str, Any] = {}
    for arm, rs in arms.items():
        entry = _arm_summary(rs, key)
        if entry is not None:
            out[arm] = entry
    return out


def _arm_summary(rs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """:func:`summarize`'s entry of one arm's runs ``rs`` (None when none of them has a final accuracy)."""
    init, finals, vals, bests, gains = [], [], [], [], []
    pol: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # policy -> key -> values
    spent: dict[str, list[float]] = defaultdict(list)
    for r in rs:
        _, avg = _series(r["evals"], "average", key)
        final = evidence.final_accuracy(r, "test")
        if not avg or final is None:
            continue
        init.append(avg[0])
        finals.append(final)
        if (v := evidence.final_accuracy(r, "val")) is not None:
            vals.append(v)
        bests.append(max(avg))
        gains.append(100 * (avg[-1] - avg[0]))
        for k, v in evidence.compute_spent(r).items():
            spent[k].append(v)
        _policy_values(r, key, pol)
    if not finals:
        return None
    entry: dict[str, Any] = {
        "avg_test_acc_final": _stat(finals), "avg_curve_acc_initial": _stat(init),
        "avg_curve_acc_best": _stat(bests), "avg_gain_pts": _stat(gains), "curve_split": key.split("_")[0],
        "seeds": [r["seed"] for r in rs], "single_model": single_model(rs[0]),
        "compute_per_run": {k: _stat(v) for k, v in spent.items()},
    }
    if vals:
        entry["avg_val_acc_final"] = _stat(vals)
    for kind in ("initial", "final", "best"):
        entry[f"per_policy_{kind}"] = {p: _stat(v[kind]) for p, v in pol.items()}
    entry["per_policy_skill_initial"] = {p: {k.split("/", 1)[1]: _stat(x) for k, x in v.items()
                                             if k.startswith("initial/")} for p, v in pol.items()}
    entry["per_policy_skill_final"] = {p: {k.split("/", 1)[1]: _stat(x) for k, x in v.items()
                                           if k.startswith("final/")} for p, v in pol.items()}
    entry["peer_rows_total"] = {p: _stat(v["peer_rows_total"]) for p, v in pol.items()}
    entry["rows_used_per_step"] = {p: _stat(v["rows_used_per_step"]) for p, v in pol.items()}
    entry["thl_residual"] = {p: {k: _stat(v[k]) for k in THL_KEYS if v.get(k)} for p, v in pol.items()}
    return entry


def _policy_values(r: dict[str, Any], key: str, pol: dict[str, dict[str, list[float]]]) -> None:
    """Add run ``r``'s per-policy figures to ``pol`` (policy -> figure -> one value per run): accuracy
    initial, final (test) and best on the curve, per skill, peer rows and THL residuals."""
    test_final = evidence.final_per_policy(r, "test")
    for p in r["policies"]:
        _, ys = _series(r["evals"], p, key)
        if not ys or p not in test_final:
            continue
        pol[p]["initial"].append(ys[0])
        pol[p]["final"].append(test_final[p]["all"])
        pol[p]["best"].append(max(ys))
        for sk in skills(r):
            _, ks = _series(r["evals"], p, f"{key}/{sk}")
            if ks and sk in test_final[p]:
                pol[p][f"initial/{sk}"].append(ks[0])
                pol[p][f"final/{sk}"].append(test_final[p][sk])
        own_steps = [s for s in r["steps"] if s["policy"] == p]
        pol[p]["peer_rows_total"].append(float(sum(s.get("peer_rows", 0) for s in own_steps)))
        pol[p]["rows_used_per_step"].append(
            statistics.fmean(s.get("peer_rows", 0) for s in own_steps) if own_steps else 0.0)
        for tk in THL_KEYS:
            got = [s[tk] for s in own_steps if tk in s]
            if got:
                pol[p][tk].append(statistics.fmean(got))


def share_of_peers(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`mutualrl.study.evidence.peers_share` of ``runs``: sharing arms against single-model arms."""
    arms = {r["arm"]: single_model(r) for r in runs}
    sharing = [a for a, single in arms.items() if not single]
    baselines = [a for a, single in arms.items() if single]
    return evidence.peers_share(runs, sharing, baselines) if sharing and baselines else None


def _order(arms: Any) -> list[str]:
    return sorted(arms, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """The paper-style figure: rows test accuracy / weak-skill accuracy / train reward, columns
    policies + average; one line per arm (mean over seeds, band = spread over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = runs[0]["policies"] + ["average"]
    arms = _order({r["arm"] for r in runs})
    weak = {p: weak_skill(runs[0], p) for p in runs[0]["policies"]}
    acc = curve_key(runs)
    rows = [(acc, "evals", False, f"held-out {'validation' if acc == 'val_acc' else 'test'} accuracy"),
            ("weak", "evals", False, "accuracy on the weak skill"),
            ("reward_mean", "steps", True, "train reward (smoothed)")]
    fig, axes = plt.subplots(len(rows), len(policies), figsize=(4 * len(policies), 9.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ai, arm in enumerate(arms):
        rs = [r for r in runs if r["arm"] == arm]
        for ci, pol in enumerate(policies):
            for ri, (key, src, smooth, _) in enumerate(rows):
                if key == "weak":
                    if pol == "average" or weak.get(pol) is None:
                        continue
                    key = f"{acc}/{weak[pol]}"
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
                    sd = [statistics.stdev([c[1][i] for c in curves]) for i in range(n)]
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
    prefix = "val_acc/" if any(k.startswith("val_acc/") for k in r0) else "test_acc/"
    per = {k.split("/", 1)[1]: v for k, v in r0.items() if k.startswith(prefix)}
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


def peers_share_section(runs: list[dict[str, Any]]) -> list[str]:
    """The report's lead: the best sharing arm minus the strongest single-model arm (both chosen on
    validation), on test, per seed, with the 95 % interval; what the sharing arm spent against it."""
    share = share_of_peers(runs)
    if share is None:
        has_both = len({single_model(r) for r in runs}) == 2
        no_val = curve_key(runs) != "val_acc"
        why = ("The runs have no validation split (`task.val_size`): the best sharing arm and the strongest "
               "baseline are chosen on validation, so no peers' share is claimed here.")
        return ["## The peers' share", "", why] if has_both and no_val else []
    vals = ", ".join(f"{v:+.1f}" for v in share["values"])
    lo, hi = share["ci95"]
    ci = (f"95 % interval [{lo:+.1f}, {hi:+.1f}] (t over {share['n']} seeds)" if share["n"] > 1
          else "one seed: no interval")
    spent = {a: [evidence.compute_spent(r) for r in runs if r["arm"] == a]
             for a in (share["best_sharing_arm"], share["strongest_baseline"])}
    ratio = ""
    if all(spent.values()):
        tok = [statistics.fmean(x["trained_tokens"] for x in spent[a]) for a in spent]
        ratio = f"; it trained {tok[0] / max(tok[1], 1.0):.2f}x the baseline's tokens"
        per_policy = evidence.token_ratios(runs, share["best_sharing_arm"], share["strongest_baseline"])["per_policy"]
        if len(per_policy) > 1:
            ratio += " (" + ", ".join(f"{p} {v['mean']:.2f}x" for p, v in per_policy.items()) + ")"
    lead = (f"**{share['best_sharing_arm']}** against the strongest single-model arm "
            f"**{share['strongest_baseline']}** (both chosen by validation accuracy), on test: "
            f"**{share['mean']:+.1f} points**, {ci}; per seed {vals}{ratio}.")
    return ["## The peers' share", "", lead]


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
    split = summary[arms[0]]["curve_split"] if arms else "test"
    lines = [f"# {title}", "", f"{len(runs)} runs, {steps} steps each; seeds per arm: "
             + ", ".join(f"{a} = {len(summary[a]['seeds'])}" for a in arms) + ".", *(notes or []), ""]
    lines += peers_share_section(runs)
    lines += ["", "| arm | " + " | ".join(f"{p} final" for p in policies)
              + " | average final test (mean ± std) | gain (pts) | trained tokens | optimizer steps | wall s |",
              "|---|" + "---|" * (len(policies) + 5)]
    for a in arms:
        s = summary[a]
        f = s["avg_test_acc_final"]
        c = s.get("compute_per_run", {})
        cells = [f"{c[k]['mean']:,.0f}" if k in c else "n/a" for k in ("trained_tokens", "optimizer_steps", "wall_s")]
        lines.append(f"| {a} | " + " | ".join(_pm(s["per_policy_final"][p]) if p in s["per_policy_final"] else "n/a"
                                             for p in policies)
                     + f" | {_pm(f)} | {_pm(s['avg_gain_pts'], fmt='+.1f')} | " + " | ".join(cells) + " |")
    lines += ["", ("Final accuracy: greedy exact match on the held-out test problems, the same for every arm"
                   + (", read once, at the end of each run; gain: on validation from step 0 to the end"
                      if split == "val" else "; gain: from step 0 to the end")
                   + ". Compute per run, both policies: trained tokens (completion tokens of every training row, "
                   "each optimizer step counted), optimizer steps, wall time.")]
    if types:
        lines += ["", (f"Per skill ({split} at step 0 → test at the end, mean over seeds), and peer rows trained on "
                       "per run:"), "",
                  "| arm | policy | " + " | ".join(types) + " | peer rows |", "|---|---|" + "---|" * (len(types) + 1)]
        for a in arms:
            s = summary[a]
            for p in policies:
                ini, fin = s["per_policy_skill_initial"].get(p, {}), s["per_policy_skill_final"].get(p, {})
                cells = [f"{ini[t]['mean']:.3f} → {fin[t]['mean']:.3f}" if t in fin else "n/a" for t in types]
                lines.append(f"| {a} | {p} | " + " | ".join(cells) + f" | {s['peer_rows_total'][p]['mean']:.0f} |")
    lines += transfer_section(summary, runs)
    lines += ["", "![curves](curves.png)", "",
              ("Test accuracy is greedy exact match on the same held-out problems for every policy and arm; the "
               "middle row is each policy's weak skill (its worst task type at step 0); train reward is the mean "
               "reward of sampled completions (smoothed over 10 steps). Bands: spread over seeds."), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
