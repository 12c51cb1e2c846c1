"""What a comparison of arms may claim: paired differences over seeds with a t interval, the compute
each arm spent, and the peers' share (the best sharing arm minus the strongest single-model
baseline, both picked on validation, measured on test).

A *run* here is what :func:`mutualrl.study.report.load_run` reads (config, eval rows, step rows) with its
``arm`` label. Its figures: the final accuracy on the test split (read once, at the end, when the
run has a validation split) and on validation, each the mean over the run's policies; and the
compute it spent: trained tokens (completion tokens of every training row, each optimizer phase
counted), optimizer steps, sampled (rollout) tokens and wall time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mutualrl.study.power import DEFAULT_POWER, seeds_for_power

T_975: dict[int, float] = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
                           9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 14: 2.145, 19: 2.093, 29: 2.045}
"""Two-sided 95 % quantiles of Student's t by degrees of freedom (a missing df takes the next smaller
one listed: a slightly wider interval)."""


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (1.96 beyond the table)."""
    if df < 1:
        return math.inf
    if df > 29:
        return 1.96
    return T_975[max(k for k in T_975 if k <= df)]


def interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and the 95 % t interval of the mean of ``values`` (paired
    differences: one per seed, on the same problems): ``mean ± t(n-1) sd / sqrt(n)``."""
    v = [float(x) for x in values]
    n = len(v)
    mean = statistics.fmean(v) if v else math.nan
    sd = statistics.stdev(v) if n > 1 else math.nan
    half = t_quantile(n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    return {"mean": mean, "sd": sd, "ci95": [mean - half, mean + half], "n": n, "values": v,
            "method": "t interval over seeds (paired: same seed, same problems)"}


def _final(rows: Iterable[Mapping[str, Any]], policy: str, key: str) -> float | None:
    sel = [r for r in rows if r.get("policy") == policy and key in r]
    return float(max(sel, key=lambda r: r["step"])[key]) if sel else None


def final_accuracy(run: Mapping[str, Any], split: str = "test") -> float | None:
    """The run's final accuracy on ``split`` (``test`` or ``val``), the mean over its policies; None
    when a policy was never evaluated on it."""
    vals = [_final(run["evals"], p, f"{split}_acc") for p in run["policies"]]
    return None if not vals or any(v is None for v in vals) else statistics.fmean(vals)  # type: ignore[arg-type]


def final_per_policy(run: Mapping[str, Any], split: str = "test") -> dict[str, dict[str, float]]:
    """Per policy: its final accuracy on ``split`` overall (``all``) and per task type."""
    out: dict[str, dict[str, float]] = {}
    for p in run["policies"]:
        last = [r for r in run["evals"] if r.get("policy") == p and f"{split}_acc" in r]
        if not last:
            continue
        row = max(last, key=lambda r: r["step"])
        out[p] = {"all": float(row[f"{split}_acc"])} | {k.split("/", 1)[1]: float(v) for k, v in row.items()
                                                        if k.startswith(f"{split}_acc/")}
    return out


def compute_spent(run: Mapping[str, Any]) -> dict[str, float]:
    """What the run spent, summed over its policies and steps: trained tokens, optimizer steps,
    sampled tokens, peer rows used, FLOPs by phase (sampling, scoring, update) and in all where the
    run counted them; and its wall time (``summary.json``, when read)."""
    steps = run["steps"]
    out = {"trained_tokens": float(sum(s.get("train_tokens", 0) for s in steps)),
           "optimizer_steps": float(sum(s.get("optimizer_steps", 0) for s in steps)),
           "sampled_tokens": float(sum(s.get("gen_tokens", 0) for s in steps)),
           "peer_rows": float(sum(s.get("peer_rows", 0) for s in steps))}
    if any("flops_update" in s for s in steps):  # runs of a revision that counts FLOPs by phase
        for phase in ("sampling", "scoring", "update"):
            out[f"flops_{phase}"] = float(sum(s.get(f"flops_{phase}", 0.0) for s in steps))
        out["flops"] = out["flops_sampling"] + out["flops_scoring"] + out["flops_update"]
    if run.get("wall_s") is not None:
        out["wall_s"] = float(run["wall_s"])
    return out


MATCH_KEYS: tuple[str, ...] = ("trained_tokens", "optimizer_steps", "flops")
"""What a compute match holds within 10 %, per seed and policy: trained tokens, optimizer steps and
FLOPs in all (sampling, scoring and update; where both runs counted them)."""
RATIO_KEYS: tuple[str, ...] = (*MATCH_KEYS, "sampled_tokens")
"""What :func:`policy_ratios` reports per seed and policy: the match's keys, and the sampled tokens
(rollouts), which a control that spends its peers' scoring FLOPs in own samples does not match."""


def compute_by_policy(run: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """What the run spent per policy: trained tokens, optimizer steps and (where the run counted them)
    FLOPs in all and by phase."""
    out: dict[str, dict[str, float]] = {}
    for s in run["steps"]:
        if "policy" not in s:
            continue
        d = out.setdefault(s["policy"], {"trained_tokens": 0.0, "optimizer_steps": 0.0, "sampled_tokens": 0.0})
        d["trained_tokens"] += float(s.get("train_tokens", 0))
        d["optimizer_steps"] += float(s.get("optimizer_steps", 0))
        d["sampled_tokens"] += float(s.get("gen_tokens", 0))
        if "flops_update" in s:
            for phase in ("sampling", "scoring", "update"):
                d[f"flops_{phase}"] = d.get(f"flops_{phase}", 0.0) + float(s.get(f"flops_{phase}", 0.0))
            d["flops"] = d["flops_sampling"] + d["flops_scoring"] + d["flops_update"]
    return out


def tokens_by_policy(run: Mapping[str, Any]) -> dict[str, float]:
    """The run's trained tokens per policy (each optimizer phase counted)."""
    return {p: d["trained_tokens"] for p, d in compute_by_policy(run).items()}


NOTHING_SPENT = 1e9
"""The ratio recorded when one run spent something and the other nothing (finite, so the JSON stays
valid; far outside any match)."""
_NOTHING = {"trained_tokens": 0.0, "optimizer_steps": 0.0, "sampled_tokens": 0.0}
"""What a run that never trained a policy spent on it (FLOPs: not counted, so not compared)."""


def ratio(num: float, den: float) -> float:
    """``num / den`` as a compute ratio: 1 when both are 0, :data:`NOTHING_SPENT` when only ``den`` is
    (and ``1 / NOTHING_SPENT`` when only ``num`` is, through the division), so a run that spent nothing
    is outside the match whichever way round it is compared."""
    if den > 0:
        return num / den
    return 1.0 if num <= 0 else NOTHING_SPENT


def policy_ratios(runs: Sequence[Mapping[str, Any]], arm: str, baseline: str,
                  seeds: Iterable[int] | None = None) -> dict[str, Any]:
    """``arm``'s compute over ``baseline``'s per policy, per seed both ran (of ``seeds`` when given),
    for each of :data:`RATIO_KEYS` both counted (FLOPs are left out where one run did not count them; a
    policy one run never trained counts as 0 spent: :func:`ratio`): ``{key: {policy: {mean, values}}}``,
    with ``seeds`` (those compared)."""
    keep = None if seeds is None else {int(s) for s in seeds}
    mine = {int(r["seed"]): r for r in runs if r["arm"] == arm and (keep is None or int(r["seed"]) in keep)}
    theirs = {int(r["seed"]): r for r in runs if r["arm"] == baseline and (keep is None or int(r["seed"]) in keep)}
    both = sorted(set(mine) & set(theirs))
    out: dict[str, dict[str, list[float]]] = {}
    for s in both:
        a, b = compute_by_policy(mine[s]), compute_by_policy(theirs[s])
        for p in [*a, *(q for q in b if q not in a)]:
            num, den = {**_NOTHING, **a.get(p, {})}, {**_NOTHING, **b.get(p, {})}
            for k in RATIO_KEYS:
                if k in num and k in den:  # FLOPs only where both runs counted them
                    out.setdefault(k, {}).setdefault(p, []).append(ratio(num[k], den[k]))
    return {"seeds": both, **{k: {p: {"mean": statistics.fmean(v), "values": v} for p, v in by_p.items()}
                              for k, by_p in out.items()}}


def spread(ratio: float) -> float:
    """How far a compute ratio is from 1 either way round: ``max(ratio, 1 / ratio)`` (1.25 for both
    0.8 and 1.25; ``inf`` for a ratio of 0)."""
    return max(ratio, 1.0 / ratio) if ratio > 0 else math.inf


def farthest(ratios: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Of :func:`policy_ratios`, each quantity's ratio farthest from 1 (by :func:`spread`) per policy
    (any seed): ``{key: {policy: ratio}}``."""
    return {k: {p: max(c["values"], key=spread) for p, c in cells.items()}
            for k, cells in ratios.items() if k != "seeds"}


def within(ratio: float, tol: float = 0.10) -> bool:
    """Whether a compute ratio is within ``tol`` of 1 **either way round**: neither run spent more than
    ``1 + tol`` times the other's (``1/1.1 <= ratio <= 1.1`` at 10 %), so the verdict is the same for
    ``a / b`` and ``b / a`` (a control's over the sharing arm's, or the reverse)."""
    return spread(ratio) <= 1.0 + tol + 1e-12


def inside_match(ratios: Mapping[str, Any], tol: float = 0.10) -> bool:
    """Whether every per-seed, per-policy ratio of :func:`policy_ratios` of the match's quantities
    (:data:`MATCH_KEYS`) is :func:`within` ``tol`` of 1 (and there is one to judge: trained tokens
    at least)."""
    values = [v for k in MATCH_KEYS for p in ratios.get(k, {}).values() for v in p["values"]]
    return bool(values) and "trained_tokens" in ratios and all(within(v, tol) for v in values)


def token_ratios(runs: Sequence[Mapping[str, Any]], arm: str, baseline: str) -> dict[str, Any]:
    """``arm``'s trained tokens over ``baseline``'s, per seed both ran (both policies together) and per
    policy (the mean and the per-seed values): a pair matched on the sum can leave one policy
    training far more than its control, and that policy's gain is then not the peers' alone."""
    mine = {int(r["seed"]): r for r in runs if r["arm"] == arm}
    theirs = {int(r["seed"]): r for r in runs if r["arm"] == baseline}
    seeds = sorted(set(mine) & set(theirs))
    per_seed = {s: ratio(compute_spent(mine[s])["trained_tokens"], compute_spent(theirs[s])["trained_tokens"])
                for s in seeds}
    per_policy = policy_ratios(runs, arm, baseline).get("trained_tokens", {})
    return {"seeds": seeds, "per_seed": [per_seed[s] for s in seeds], "per_policy": per_policy}


def by_seed(runs: Iterable[Mapping[str, Any]], arm: str, split: str = "test") -> dict[int, float]:
    """Final accuracy of ``arm``'s runs on ``split``, by seed."""
    out = {}
    for r in runs:
        if r["arm"] == arm:
            acc = final_accuracy(r, split)
            if acc is not None:
                out[int(r["seed"])] = acc
    return out


def paired(runs: Sequence[Mapping[str, Any]], arm: str, baseline: str, split: str = "test") -> dict[str, Any]:
    """``arm`` minus ``baseline`` in points, per seed both ran (same seed: same prompts, same test
    problems), with :func:`interval`."""
    a, b = by_seed(runs, arm, split), by_seed(runs, baseline, split)
    seeds = sorted(set(a) & set(b))
    out = interval([100 * (a[s] - b[s]) for s in seeds])
    return {"arm": arm, "baseline": baseline, "seeds": seeds, **out}


def strongest(runs: Sequence[Mapping[str, Any]], arms: Iterable[str], split: str = "val") -> str | None:
    """The arm of ``arms`` with the highest mean final accuracy on ``split`` (validation: the choice
    is never made on test)."""
    scored = [(statistics.fmean(v.values()), a) for a in arms if (v := by_seed(runs, a, split))]
    return max(scored)[1] if scored else None


def peers_share(runs: Sequence[Mapping[str, Any]], sharing: Iterable[str], baselines: Iterable[str]
                ) -> dict[str, Any] | None:
    """The best sharing arm minus the strongest single-model baseline (each chosen by validation
    accuracy), on test, paired per seed: {best sharing arm, strongest baseline, mean, ci95, values}."""
    best, base = strongest(runs, sharing), strongest(runs, baselines)
    if best is None or base is None:
        return None
    out = paired(runs, best, base)
    return {"best_sharing_arm": best, "strongest_baseline": base, "chosen_by": "validation accuracy",
            **{k: v for k, v in out.items() if k not in ("arm", "baseline")}}


def matched_peers_share(runs: Sequence[Mapping[str, Any]], sharing: Iterable[str], baselines: Iterable[str],
                        tol: float = 0.10) -> dict[str, Any] | None:
    """The peers' share against the strongest baseline *inside the match*: of the ``baselines`` whose
    compute lies within ``tol`` of the best sharing arm's on every seed and policy (trained tokens,
    optimizer steps, FLOPs: :func:`inside_match`), the one best on validation; None when none is."""
    best = strongest(runs, sharing)
    if best is None:
        return None
    inside = [b for b in baselines if inside_match(policy_ratios(runs, best, b), tol)]
    base = strongest(runs, inside)
    if base is None:
        return {"best_sharing_arm": best, "baselines_inside_match": [], "strongest_baseline": None}
    out = paired(runs, best, base)
    return {"best_sharing_arm": best, "strongest_baseline": base, "baselines_inside_match": inside,
            "chosen_by": "validation accuracy, among the baselines inside the match",
            **{k: v for k, v in out.items() if k not in ("arm", "baseline")}}


MIN_SEEDS = 5
"""The final seeds a study needs before a target can be met (the protocol's minimum)."""


def target_verdict(share: Mapping[str, Any] | None, target: float | None, baseline_inside: bool | None,
                   n_seeds: int, min_seeds: int = MIN_SEEDS) -> dict[str, Any]:
    """The study's target and whether it was met, with every reason it was not: the mean below the
    target, the 95 % interval touching 0, the headline's baseline outside the per-policy match (or the
    match unknown), fewer than ``min_seeds`` final seeds, no peers' share at all. A miss with a per-seed
    sd also gives ``power``: the seeds a study would need for 80 % power at the target, that sd taken
    as the true one (:func:`~mutualrl.study.power.seeds_for_power`)."""
    if target is None:
        return {"target": None, "met": None, "reasons": []}
    if not share or "mean" not in share or not share.get("ci95"):
        why = ("no baseline inside the per-policy match" if share and "strongest_baseline" in share
               and share["strongest_baseline"] is None else "no peers' share")
        return {"target": target, "met": False, "reasons": [why]}
    lo = share["ci95"][0]
    reasons = []
    if not share["mean"] >= target:
        reasons.append(f"mean {share['mean']:+.1f} below the target")
    if not lo > 0:
        reasons.append("95 % interval touches 0")
    if baseline_inside is None:
        reasons.append("per-policy compute match unknown")
    elif not baseline_inside:
        reasons.append("baseline not compute-matched per policy")
    if n_seeds < min_seeds:
        reasons.append(f"{n_seeds} final seeds (< {min_seeds})")
    out = {"target": target, "met": not reasons, "reasons": reasons, "lower_bound": lo,
           "lower_bound_below_target": lo < target}
    sd = share.get("sd")
    if reasons and isinstance(sd, int | float) and math.isfinite(sd) and sd > 0:
        # the seeds a study would need: 80 % power at the target, the observed per-seed sd taken as true
        out["power"] = {"sd": sd, "seeds_at_target": seeds_for_power(sd, target), "power": DEFAULT_POWER}
    return out


def target_text(t: Mapping[str, Any] | None, missed: str = "missed") -> str:
    """A :func:`target_verdict` (or a pending one, ``met: None``) in words: ``≥ +5: met``, ``≥ +5:
    pending: ...``, or ``≥ +5: missed (every reason; the seeds 80 % power at the target would need)``;
    ``missed`` is the word for a miss (the README table bolds it); empty without a target."""
    if not t or t.get("target") is None:
        return ""
    head = f"≥ {t['target']:+g}"
    if t["met"]:
        return f"{head}: met"
    if t["met"] is None:
        return f"{head}: {'; '.join(t['reasons'])}"
    pw = t.get("power")
    need = "" if not pw else (f"; {pw['seeds_at_target']} seeds for {pw['power']:.0%} power at the target, sd "
                              f"{pw['sd']:.1f}" if pw["seeds_at_target"] else f"; over 200 seeds for {pw['power']:.0%} "
                              f"power at the target, sd {pw['sd']:.1f}")
    return f"{head}: {missed} ({'; '.join(t['reasons'])}{need})"


def check_target(value: Any) -> float:
    """A study's target as given (points of peers' share): a positive finite number, else ValueError
    naming what to give."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected the peers' share to show, in points (a positive number such as 3), got {value!r}")
    return float(value)
