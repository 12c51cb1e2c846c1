"""The studies' evidence as one table and one figure: per study and headline arm, the final test
accuracy, the peers' share with its 95 % interval, each policy's compute against the best sharing
arm, whether the arm is inside a 10 % match on every policy, and the target with its verdict.

A *study* is a committed study JSON (``benchmarks/results/<name>.json``: ``arms``, ``peers_share``,
``final_seeds`` ...) and its *records* the compact runs beside it (``<name>_runs/``, as
:func:`mutualrl.study.records.load_records` reads them). The headline arms of a study are the best
sharing arm, the headline's baseline (both from ``peers_share``: the strongest baseline inside the
compute match, or the strongest whatever its compute where none is) and every other arm of role
``baseline``. Figures a study does not hold (FLOPs before the revision that counts them, a missing
``peers_share``) read ``n/a``; nothing is guessed.

Compute per policy: each run's steps summed per policy (trained tokens, optimizer steps, sampled
tokens, and FLOPs as ``flops_sampling + flops_scoring + flops_update`` where the steps carry them),
then per seed the arm's sum over the best sharing arm's, the mean over seeds reported: the same
ratios the study JSON's compute match judges (:func:`mutualrl.study.evidence.policy_ratios`). An arm is
*inside the match* when its ratios of trained tokens, optimizer steps and FLOPs, on every seed and
every policy, lie within 10 % of 1 either way round (neither arm spent more than 1.1x the other's:
:func:`mutualrl.study.evidence.within`; FLOPs included only where both arms counted them; the table
says when they did not); sampled tokens outside 10 % are stated beside the verdict, not judged (a
control may spend a ``distill`` arm's scoring FLOPs in own samples: the plan's amendment).

A target is *met* only when the mean reaches it, its 95 % interval lies above 0, the headline's
baseline is inside the match on every policy and the study has at least 5 final seeds; the table
states each reason a target is missed, and the seeds 80 % power at the target would need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutualrl.study.evidence import (
    MATCH_KEYS,
    RATIO_KEYS,
    farthest,
    interval,
    policy_ratios,
    spread,
    target_text,
    target_verdict,
    within,
)

START = "<!-- evidence-table:start -->"
END = "<!-- evidence-table:end -->"
"""The README markers whose block :func:`replace_block` rewrites."""

TOLERANCE = 0.10
_SHORT = {"trained_tokens": "tokens", "optimizer_steps": "steps", "sampled_tokens": "sampled", "flops": "FLOPs"}


def final_seeds(study: Mapping[str, Any]) -> list[int]:
    """The study's final seeds: the declared ones, else ``final_seeds``, else the peers' share's."""
    seeds = study.get("declared_final_seeds") or study.get("final_seeds") or (study.get("peers_share") or {}).get(
        "seeds") or []
    return sorted(int(s) for s in seeds)


def arm_table(study: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Every arm summary of the study: its headline arms and those on fewer seeds."""
    return {**study.get("arms_on_fewer_seeds", {}), **study.get("arms", {})}


def headline_arms(study: Mapping[str, Any]) -> list[str]:
    """The best sharing arm, the strongest baseline, then every other ``baseline`` arm in the order of
    the study's ``arms``; only the baselines when the study has no peers' share."""
    share = study.get("peers_share") or {}
    first = [a for a in (share.get("best_sharing_arm"), share.get("strongest_baseline")) if a]
    rest = [a for a, t in study.get("arms", {}).items() if t.get("role") == "baseline" and a not in first]
    return [*first, *rest]


def match_verdict(ratios: Mapping[str, Any], tol: float = TOLERANCE) -> dict[str, Any]:
    """Whether every per-seed, per-policy ratio of the match's quantities
    (:data:`~mutualrl.study.evidence.MATCH_KEYS`: sampled tokens are reported beside it, since a
    control may spend a ``distill`` arm's scoring FLOPs in own samples, the plan's amendment) in
    :func:`~mutualrl.study.evidence.policy_ratios` lies within ``tol`` of 1 either way round
    (:func:`~mutualrl.study.evidence.within`): the verdict (None without
    any ratio), the quantities outside (in :data:`~mutualrl.study.evidence.RATIO_KEYS` order, sampled
    tokens included, which do not decide it) with the ratio farthest from 1 of each (any seed, any
    policy), and whether FLOPs were compared (for every policy)."""
    far = farthest(ratios)
    if not far:
        return {"inside": None, "outside": [], "flops_compared": False}
    worst = {k: max(by_p.values(), key=spread) for k, by_p in far.items()}
    outside = [k for k in RATIO_KEYS if k in worst and not within(worst[k], tol)]
    policies = {p for by_p in far.values() for p in by_p}
    return {"inside": not any(k in MATCH_KEYS for k in outside), "outside": outside,
            "worst": {k: worst[k] for k in outside}, "flops_compared": policies <= set(far.get("flops", {}))}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _ratio_text(ratios: Mapping[str, Any], key: str) -> str:
    cells = [(pol, c["mean"]) for pol, c in ratios.get(key, {}).items()]
    return ", ".join(f"{pol} {m:.2f}" for pol, m in cells) if cells else "n/a"


def study_rows(label: str, study: Mapping[str, Any], runs: Sequence[Mapping[str, Any]],
               target: float | None = None) -> list[dict[str, Any]]:
    """One row per headline arm of ``study``: its accuracy and seeds, the peers' share (the best
    sharing arm's row only; with ``peers_share_any_compute`` beside it when the strongest baseline
    whatever its compute is another arm than the headline's), its compute ratios per policy against
    the best sharing arm, its match verdict, and the target's verdict (on the best sharing arm's row): the
    JSON's own ``target`` where it has one (pending while not every final seed has run), else judged
    here against ``target``."""
    share = study.get("peers_share")
    judged = study.get("target") if isinstance(study.get("target"), dict) and study["target"].get("target") else None
    best = share.get("best_sharing_arm") if share else None
    strong = share.get("strongest_baseline") if share else None
    seeds = final_seeds(study)
    table = arm_table(study)
    arms = headline_arms(study)
    ratios = {a: policy_ratios(runs, a, best, seeds) if best else {} for a in arms if a != best}
    verdicts = {a: match_verdict(r) for a, r in ratios.items()}
    rows = []
    for arm in arms:
        t = table.get(arm, {})
        test = t.get("test_final") or {}
        row: dict[str, Any] = {
            "study": label, "arm": arm, "role": t.get("role", "n/a"),
            "kind": "best sharing" if arm == best else ("strongest baseline inside the match" if share.get(
                "inside_match") else "strongest baseline") if arm == strong else "baseline",
            "seeds": list(t.get("seeds", [])), "test_acc": test.get("mean"), "test_acc_values": test.get("values", []),
            "peers_share": None, "ratios": ratios.get(arm, {}), "match": verdicts.get(arm), "target": None}
        if arm == best:
            if "mean" in share and share.get("ci95"):
                row["peers_share"] = {k: share[k] for k in ("mean", "ci95", "values", "seeds", "strongest_baseline")
                                      if k in share}
            anyc = study.get("peers_share_any_compute") or {}
            if anyc.get("ci95") and anyc.get("strongest_baseline") not in (None, strong):
                row["peers_share_any_compute"] = {k: anyc[k] for k in ("mean", "ci95", "strongest_baseline")}
            row["target"] = (dict(judged) if judged else
                             target_verdict(share, target, verdicts.get(strong, {}).get("inside"), len(seeds)))
        rows.append(row)
    if judged and judged.get("met", False) is None:  # the JSON's: not every final seed has run, no verdict yet
        rows = rows or [{"study": label, "arm": "(no headline yet)", "role": "n/a", "kind": "pending", "seeds": [],
                         "test_acc": None, "test_acc_values": [], "peers_share": None, "ratios": {}, "match": None}]
        rows[0]["target"] = dict(judged)
    return rows


def _match_text(m: Mapping[str, Any] | None) -> str:
    if m is None:
        return "(reference)"
    if m["inside"] is None:
        return "n/a"
    off = [k for k in m["outside"] if k in MATCH_KEYS]
    text = "yes" if m["inside"] else "no: " + ", ".join(f"{_SHORT[k]} {m['worst'][k]:.2f}" for k in off)
    if "sampled_tokens" in m["outside"]:  # reported, not judged: e.g. scoring FLOPs spent in own samples
        text += f"; sampled {m['worst']['sampled_tokens']:.2f}"
    return text + ("" if m["flops_compared"] else " (FLOPs n/a)")


def _target_text(t: Mapping[str, Any] | None) -> str:
    return target_text(t, missed="**missed**")


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of :func:`study_rows` (several studies concatenated) as a markdown table."""
    head = ("| study | arm | seeds | test acc. % | peers' share, pts [95 % CI] | trained tokens × best (per policy) "
            "| FLOPs × best (per policy) | within 10 % on every seed and policy (worst ratio) | target |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ps = r["peers_share"]
        share = (f"**{ps['mean']:+.1f}** [{ps['ci95'][0]:+.1f}, {ps['ci95'][1]:+.1f}] vs {ps['strongest_baseline']}"
                 if ps else "")
        if r.get("peers_share_any_compute"):  # the strongest whatever its compute, when the headline's differs
            a = r["peers_share_any_compute"]
            share += (f"; vs the strongest whatever its compute ({a['strongest_baseline']}): {a['mean']:+.1f} "
                      f"[{a['ci95'][0]:+.1f}, {a['ci95'][1]:+.1f}]")
        best = r["kind"] == "best sharing"
        tokens = "reference" if best else _ratio_text(r["ratios"], "trained_tokens")
        flops = "reference" if best else _ratio_text(r["ratios"], "flops")
        arm = f"{r['arm']} ({r['kind']})"
        lines.append(f"| {r['study']} | {arm} | {len(r['seeds'])} | {_pct(r['test_acc'])} | {share} | {tokens} "
                     f"| {flops} | {_match_text(r['match'])} | {_target_text(r['target'])} |")
    return "\n".join(lines)


def replace_block(text: str, block: str, start: str = START, end: str = END) -> str:
    """``text`` with what lies between the markers ``start`` and ``end`` replaced by ``block`` (the
    markers kept); :class:`ValueError` unless each marker occurs once, ``start`` first."""
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {start!r} and one {end!r} marker")
    i, j = text.index(start) + len(start), text.index(end)
    if j < i:
        raise ValueError(f"{end!r} comes before {start!r}")
    return text[:i] + "\n" + block.strip("\n") + "\n" + text[j:]


def figure_panel(label: str, study: Mapping[str, Any], target: float | None = None) -> dict[str, Any]:
    """One study's panel data: per headline arm its per-seed test accuracy (points, %) and the mean
    with the 95 % t interval over seeds, and (every arm but the strongest baseline) its per-seed
    difference to the strongest baseline on the seeds both ran with the paired 95 % interval; the
    title carries the peers' share."""
    table = arm_table(study)
    share = study.get("peers_share")
    strong = share.get("strongest_baseline") if share else None
    by_seed = {a: dict(zip((table.get(a) or {}).get("seeds", []),
                           ((table.get(a) or {}).get("test_final") or {}).get("values", [])))
               for a in headline_arms(study)}
    arms = []
    for arm in headline_arms(study):
        values = [100 * v for v in by_seed[arm].values()]
        if not values:
            continue
        iv = interval(values)
        entry: dict[str, Any] = {"arm": arm, "values": values, "mean": iv["mean"],
                                 "ci95": iv["ci95"] if len(values) > 1 else [iv["mean"], iv["mean"]],
                                 "difference": None}
        if strong and arm != strong and by_seed.get(strong):
            common = sorted(set(by_seed[arm]) & set(by_seed[strong]))
            if common:
                d = interval([100 * (by_seed[arm][s] - by_seed[strong][s]) for s in common])
                entry["difference"] = {"values": d["values"], "mean": d["mean"],
                                       "ci95": d["ci95"] if len(common) > 1 else [d["mean"], d["mean"]]}
        arms.append(entry)
    title = label + (f": peers' share {share['mean']:+.1f} [{share['ci95'][0]:+.1f}, {share['ci95'][1]:+.1f}]"
                     if share and "mean" in share and share.get("ci95") else "")
    return {"label": label, "title": title, "arms": arms, "strongest_baseline": strong, "target": target}


def _points(ax: Any, i: int, values: Sequence[float], mean: float, ci: Sequence[float], color: str) -> None:
    n = len(values)
    xs = [i - 0.15 + 0.2 * k / max(n - 1, 1) for k in range(n)]
    ax.scatter(xs, values, s=16, color=color, alpha=0.55, zorder=2)
    ax.errorbar([i + 0.2], [mean], yerr=[[mean - ci[0]], [ci[1] - mean]], fmt="o", color=color, capsize=4, zorder=3)


def draw_figure(panels: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One column per study (:func:`figure_panel`): above, each arm's per-seed test accuracy as points
    and its mean with the 95 % interval; below, each arm's per-seed difference to the strongest
    baseline with the paired 95 % interval, 0 and the target marked. Written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(panels), 1)
    fig, axes = plt.subplots(2, cols, figsize=(5.2 * cols, 8.2), squeeze=False, sharex="col")
    for c, panel in enumerate(panels):
        top, bottom = axes[0][c], axes[1][c]
        for i, a in enumerate(panel["arms"]):
            color = "tab:red" if i == 0 else "tab:orange" if a["arm"] == panel["strongest_baseline"] else "tab:blue"
            _points(top, i, a["values"], a["mean"], a["ci95"], color)
            if a["difference"]:
                d = a["difference"]
                _points(bottom, i, d["values"], d["mean"], d["ci95"], color)
        bottom.axhline(0.0, color="black", lw=0.8)
        if panel.get("target") is not None:
            bottom.axhline(panel["target"], color="tab:red", lw=0.8, ls="--", label=f"target {panel['target']:+g}")
            bottom.legend(fontsize=8, loc="best")
        top.set_title(panel["title"], fontsize=9)
        top.set_ylabel("final test accuracy, %")
        bottom.set_ylabel(f"minus {panel['strongest_baseline']}, points" if panel["strongest_baseline"] else "")
        bottom.set_xticks(range(len(panel["arms"])))
        bottom.set_xticklabels([a["arm"] for a in panel["arms"]], rotation=25, ha="right", fontsize=8)
        for ax in (top, bottom):
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Per-seed test accuracy (points) and mean with 95 % t interval (above); per-seed difference to the "
                 "headline's baseline, paired (below).\nRed: best sharing arm; orange: the headline's baseline (the "
                 "strongest inside the compute match, else the strongest)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
