"""A study's figures from its committed records alone: per arm accuracy and compute, the paired
differences, the peers' share, the compute match and the efficiency comparisons.

The records of study ``name`` lie in ``<results>/<name>_runs/`` and its JSON is
``<results>/<name>.json``; :func:`aggregate` reads the first, :func:`rewrite` replaces the figures of
the second (what the study run recorded about itself kept), so every figure can be recomputed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError
from mutualrl.study import evidence
from mutualrl.study.provenance import git_rev, write_json
from mutualrl.study.records import load_records


class StudyError(UserError):
    """A study's records cannot make the asked figures (runs of one seed on other weights, a run
    without validation accuracy). The CLI prints it and exits with code 2."""


PROTOCOL = {
    "validation": "task.val_size problems held out of training (the last of each type's training list, the "
                  "zoo builds' own validation slice); every choice (each family's candidate, the strongest "
                  "baseline, the best sharing arm) by mean final validation accuracy",
    "test": "read once per run, at its end; reported as it is",
    "seeds": "a run's seed sets its prompt stream (task.prompt_seed follows it) and its sampling",
    "interval": "paired differences per seed (same seed: same prompts, same test problems), mean, sample sd "
                "and the 95 % t interval over seeds",
    "compute": "trained tokens (completion tokens of every training row, each optimizer phase counted), "
               "optimizer steps, sampled tokens and FLOPs (sampling, scoring, update) per run and per policy; a "
               "baseline is inside the match when each policy's trained tokens, optimizer steps and FLOPs are "
               "within 10 % of the best sharing arm's on every seed",
    "provenance": "each run's compact metrics and training revision in <study>_runs/; this file is "
                  "aggregated from them alone",
}
"""How every figure of a study's JSON was made (written into it)."""

AGGREGATE_KEYS = ("final_seeds", "arms", "peers_share", "pairwise", "compute_match", "efficiency", "matched_sharing",
                  "arms_on_fewer_seeds", "on_common_seeds", "peers_share_any_compute", "peers_share_inside_match", "target")
"""The keys of a study's JSON that :func:`aggregate` computes (the rest describe the run that wrote it)."""


def runs_dir(results: Path, name: str) -> Path:
    """Where study ``name`` keeps its records: ``<results>/<name>_runs``."""
    return Path(results) / f"{name}_runs"


def result_path(results: Path, name: str) -> Path:
    """Study ``name``'s JSON: ``<results>/<name>.json``."""
    return Path(results) / f"{name}.json"


def final_val(run: Mapping[str, Any]) -> float:
    """A run's final validation accuracy (the mean over its policies); :class:`StudyError` without one."""
    v = evidence.final_accuracy(run, "val")
    if v is None:
        raise StudyError(f"run {run['arm']} seed {run['seed']} has no validation accuracy: the protocol chooses on "
                         "a validation split (set task.val_size)")
    return v


def aggregate(results: Path, name: str, arms: Sequence[str] | None = None,
              final_seeds: Sequence[int] | None = None, target: float | None = None) -> dict[str, Any]:
    """Study ``name``'s figures from its records in ``results`` alone.

    The final seeds are ``final_seeds`` when given (runs on other seeds, such as a chosen arm's tuning
    run, are left out), else the longest seed list any arm holds; the arms holding all of them make the
    headline (``arms``, ``peers_share``). An arm trained on fewer seeds (a study whose later seeds
    trained only the headline's arms) is kept apart in ``arms_on_fewer_seeds``, over its own seeds, and
    ``on_common_seeds`` repeats the peers' share over the seeds every arm holds, every arm competing:
    so the strongest baseline among all the chosen arms stays visible. ``target`` (points, the plan's):
    ``target`` holds whether the headline met it and every reason it did not, with the seeds 80 %
    power at the target would need on a miss (:func:`~mutualrl.study.evidence.target_verdict`); ``met:
    None`` (pending) while any arm lacks a record of a final seed (or none has any)."""
    runs = [r for r in load_records(runs_dir(results, name)) if (arms is None or r["arm"] in arms)
            and (final_seeds is None or r["seed"] in final_seeds)]
    check_paired_builds(runs)
    roles = {r["arm"]: r["role"] for r in runs}
    seeds_of: dict[str, list[int]] = {}
    for r in runs:
        seeds_of.setdefault(r["arm"], []).append(r["seed"])
    final_seeds = sorted(final_seeds) if final_seeds is not None else (
        sorted(max(seeds_of.values(), key=len)) if seeds_of else [])
    final = [a for a, s in seeds_of.items() if set(final_seeds) <= set(s)]  # arms of the final round
    fewer = [a for a in seeds_of if a not in final]
    out: dict[str, Any] = {"study": name, "protocol": PROTOCOL, "final_seeds": final_seeds,
                           "arms": {a: arm_summary(runs, a, final_seeds) for a in final},
                           "git_rev": git_rev(), "quick": False}
    out.update(comparisons(runs, roles, final, final_seeds, out["arms"]))
    if target is not None:
        share = out.get("peers_share")
        short = sorted(set(fewer) | (set(arms or []) - set(final)))  # arms without a record of every final seed
        out["target"] = ({"target": target, "met": None, "reasons": [
            f"pending: {', '.join(short) or 'no arm'} not yet on every final seed {final_seeds}"]}
            if short or not runs else evidence.target_verdict(
                share, target, share.get("inside_match") if share else None, len(final_seeds)))
    if fewer:
        out["arms_on_fewer_seeds"] = {a: arm_summary(runs, a, sorted(seeds_of[a])) for a in fewer}
        common = sorted(set.intersection(*(set(s) for s in seeds_of.values())))
        if common:
            every = {a: arm_summary(runs, a, common) for a in seeds_of}
            cmp = comparisons(runs, roles, list(seeds_of), common, every)
            out["on_common_seeds"] = {"seeds": common, **{k: cmp[k] for k in ("peers_share", "pairwise") if k in cmp}}
    return out


def check_paired_builds(runs: Sequence[Mapping[str, Any]]) -> None:
    """Refuse to pair runs of one seed that started from different weights (a zoo build made on
    another CPU kind under the same cache path): their difference would not be the arms'. Records
    from before the weights were recorded are not checked."""
    seen: dict[int, dict[str, str]] = {}
    for r in runs:
        if not r.get("weights"):
            continue
        first = seen.setdefault(r["seed"], {"arm": r["arm"], "weights": json.dumps(r["weights"], sort_keys=True)})
        if json.dumps(r["weights"], sort_keys=True) != first["weights"]:
            raise StudyError(f"seed {r['seed']}: {r['arm']} started from other weights ({r['weights']}) than "
                             f"{first['arm']} ({first['weights']}); runs of one seed pair only on one build: "
                             "train the seed's arms on one machine kind, or leave one out (--arms)")


def arm_summary(runs: Sequence[Mapping[str, Any]], arm: str, seeds: Sequence[int]) -> dict[str, Any]:
    """One arm's accuracy and compute over ``seeds`` (its runs' final test and validation accuracy,
    per policy, what they spent, the revisions that trained them)."""
    rs = [r for r in runs if r["arm"] == arm and r["seed"] in seeds]
    test = [evidence.final_accuracy(r, "test") for r in rs]
    val = [evidence.final_accuracy(r, "val") for r in rs]
    spent = [evidence.compute_spent(r) for r in rs]
    per_pol = [evidence.final_per_policy(r, "test") for r in rs]
    by_pol = [evidence.compute_by_policy(r) for r in rs]
    return {"role": rs[0]["role"], "family": rs[0]["family"], "strategy": rs[0]["strategy"],
            "overrides": rs[0]["overrides"], "seeds": [r["seed"] for r in rs],
            "test_final": summary(test), "val_final": summary(val),
            "per_policy_test_final": {p: {k: statistics.fmean(x[p][k] for x in per_pol) for k in per_pol[0][p]}
                                      for p in per_pol[0]},
            **{k: summary([s.get(k, 0.0) for s in spent]) for k in spent[0]},
            "per_policy_compute": {p: {k: statistics.fmean(x[p].get(k, 0.0) for x in by_pol) for k in by_pol[0][p]}
                                   for p in by_pol[0]},
            "git_revs": sorted({str(r.get("git_rev")) for r in rs})}


def compute_ratios(runs: Sequence[Mapping[str, Any]], table: Mapping[str, Mapping[str, Any]], arm: str,
                   baseline: str) -> dict[str, Any]:
    """``arm``'s compute over ``baseline``'s: the means' ratios of trained tokens, optimizer steps,
    sampled tokens and (where both arms' runs counted them) FLOPs in all and of scoring (``evidence.ratio``:
    a baseline that spent none, as a control spends no scoring, gives its capped value); the trained
    tokens' ratio per seed; and per policy and seed, the ratios of trained tokens, optimizer steps,
    FLOPs and sampled tokens (``<key>_per_policy``; the verdicts judge the first three)."""
    tok = evidence.token_ratios(runs, arm, baseline)
    by_policy = evidence.policy_ratios(runs, arm, baseline)
    keys = ["trained_tokens", "optimizer_steps", "sampled_tokens"]
    keys += [k for k in ("flops", "flops_scoring") if k in table[arm] and k in table[baseline]]
    return {**{k: evidence.ratio(table[arm][k]["mean"], table[baseline][k]["mean"]) for k in keys},
            "trained_tokens_per_seed": tok["per_seed"],
            **{f"{k}_per_policy": by_policy[k] for k in evidence.RATIO_KEYS if k in by_policy}}


def _headline(sel: Sequence[Mapping[str, Any]], table: Mapping[str, Mapping[str, Any]], share: Sequence[str],
              base: Sequence[str]) -> dict[str, Any]:
    """The peers' share, every sharing arm against every baseline, and the compute match.

    ``peers_share`` is the headline: the best sharing arm (by validation) minus the strongest
    baseline **inside the compute match** (of the baselines whose trained tokens, optimizer steps and
    FLOPs are within 10 % of the best sharing arm's on every seed and policy, the best on validation;
    ``inside_match: true``), or, when no baseline is inside, minus the strongest baseline whatever its
    compute (``inside_match: false``, a headline the target cannot be met on). ``compute_match`` is
    that pair's. Beside it, ``peers_share_any_compute``: minus the strongest baseline whatever its
    compute, with its own ``compute_match``."""
    out: dict[str, Any] = {"pairwise": [evidence.paired(sel, s, b) for s in share for b in base]}
    anyc = evidence.peers_share(sel, share, base)
    if anyc is None:
        return {"peers_share": None, **out}
    inside = evidence.matched_peers_share(sel, share, base)
    if inside is not None and inside.get("strongest_baseline"):
        head = {**inside, "inside_match": True}
    else:
        head = {**anyc, "inside_match": False, "baselines_inside_match": []}
    best = head["best_sharing_arm"]
    out["peers_share"] = head
    out["compute_match"] = match_summary(compute_ratios(sel, table, best, head["strongest_baseline"]))
    out["peers_share_any_compute"] = {
        **anyc, "compute_match": match_summary(compute_ratios(sel, table, best, anyc["strongest_baseline"]))}
    return out


def match_summary(cm: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`compute_ratios` with its verdicts: ``within_10_percent`` on the means (trained tokens,
    optimizer steps, FLOPs) and ``every_seed_and_policy_within_10_percent`` (each policy's ratios of
    the three on every seed, and the pair's trained tokens per seed), each ratio judged either way
    round (:func:`~mutualrl.study.evidence.within`)."""
    per_run = [*cm["trained_tokens_per_seed"],
               *(v for k in evidence.MATCH_KEYS for p in cm.get(f"{k}_per_policy", {}).values() for v in p["values"])]
    return {**cm, "within_10_percent": all(evidence.within(cm[k]) for k in evidence.MATCH_KEYS if k in cm),
            "every_seed_and_policy_within_10_percent": bool(per_run) and all(evidence.within(x) for x in per_run)}


def comparisons(runs: Sequence[Mapping[str, Any]], roles: Mapping[str, str], arms: Sequence[str],
                seeds: Sequence[int], table: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The peers' share, the pairwise differences, the compute match and the efficiency comparisons
    among ``arms`` over ``seeds``."""
    base = [a for a in arms if roles[a] == "baseline"]
    share = [a for a in arms if roles[a] == "sharing"]
    sel = [r for r in runs if r["seed"] in seeds and r["arm"] in arms]
    out: dict[str, Any] = _headline(sel, table, share, base) if base and share else {}
    held = [a for a in arms if roles[a] == "matched_sharing"]
    if held and base:
        strong = evidence.strongest(sel, base)
        out["matched_sharing"] = {a: {"vs_strongest_baseline": evidence.paired(sel, a, strong),
                                      "compute_match": compute_ratios(sel, table, a, strong)} for a in held}
    eff = [a for a in arms if roles[a] == "efficiency"]
    half = [a for a in arms if roles[a] == "half_baseline"]
    if eff and base:
        strong_full = evidence.strongest(sel, base)
        out["efficiency"] = {e: {"vs_full_budget": evidence.paired(sel, e, strong_full),
                                 **({"vs_half_budget": evidence.paired(sel, e, evidence.strongest(sel, half))}
                                    if half else {})} for e in eff}
    return out


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample sd (0 for one value) and the values, Nones left out; ``{}`` when none is left."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {}
    return {"mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}


def committed_arms(results: Path, name: str) -> list[str] | None:
    """The arms the committed JSON of study ``name`` reports (headline and fewer seeds), or None."""
    path = result_path(results, name)
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return [*result.get("arms", {}), *result.get("arms_on_fewer_seeds", {})] or None


def committed_final_seeds(results: Path, name: str) -> list[int] | None:
    """The final seeds the committed JSON of study ``name`` declared (fresh seeds apart from the
    tuning seeds), or None (then the longest seed list an arm holds)."""
    path = result_path(results, name)
    return json.loads(path.read_text()).get("declared_final_seeds") if path.is_file() else None


def committed_target(results: Path, name: str) -> float | None:
    """The target (points) the committed JSON of study ``name`` was judged against, or None."""
    path = result_path(results, name)
    t = json.loads(path.read_text()).get("target") if path.is_file() else None
    return t.get("target") if isinstance(t, dict) else None


def rewrite(results: Path, name: str, result: Mapping[str, Any], seeds_given: bool = False,
            how: str = "") -> dict[str, Any]:
    """Replace the figures of the committed ``<results>/<name>.json`` with ``result`` (a fresh
    :func:`aggregate`): what the study run recorded about itself (tuning, notes, machine, load, wall
    time, its extras) is kept, the aggregated keys are replaced (one the new aggregation lacks is
    dropped), and a note says when, how (``how``: the command) and from which seeds it was
    re-aggregated. ``seeds_given``: a later plain re-aggregation takes the same final seeds."""
    path = result_path(results, name)
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = {k: v for k, v in old.items() if k not in AGGREGATE_KEYS and k not in result}
    note = (f"Figures re-aggregated at {result.get('git_rev')} from the committed runs in {name}_runs/"
            + (f" ({how})" if how else "") + f", final seeds {result.get('final_seeds')}; "
            "machine, load, jobs and wall_s are those of the study run that wrote this file before.")
    out = {**kept, **result, "notes": [*old.get("notes", []), note]}
    if seeds_given:
        out["declared_final_seeds"] = list(result["final_seeds"])
    write_json(path, out)
    return out


def _arm_line(arm: str, t: Mapping[str, Any], tail: str = "") -> str:
    return (f"{arm:<26}{t['role']:<14}{100 * t['test_final']['mean']:>11.1f}%{100 * t['val_final']['mean']:>10.1f}%"
            f"{t['trained_tokens']['mean']:>12,.0f}{t['optimizer_steps']['mean']:>10,.0f}"
            f"{t.get('wall_s', {}).get('mean', float('nan')):>8.0f}{tail}")


def _interval(label: str, v: Mapping[str, Any], tail: str = "") -> str:
    lo, hi = v["ci95"]
    return f"{label} = {v['mean']:+.1f} pts [{lo:+.1f}, {hi:+.1f}]{tail}"


def table_lines(result: Mapping[str, Any]) -> list[str]:
    """A study's JSON as a plain table: every arm's test and validation accuracy and compute, the
    peers' share with its 95 % interval and per-seed values, the compute match, the held and the
    efficiency arms."""
    head = (f"{'arm':<26}{'role':<14}{'test final':>12}{'val final':>11}{'tokens/run':>12}{'opt steps':>10}"
            f"{'wall s':>8}")
    lines = ["", head]
    lines += [_arm_line(a, t) for a, t in result["arms"].items()]
    lines += [_arm_line(a, t, f"  seeds {t['seeds']} only") for a, t in result.get("arms_on_fewer_seeds", {}).items()]
    common = result.get("on_common_seeds", {})
    for label, ps in ((" (inside the match)" if (result.get("peers_share") or {}).get("inside_match") else "",
                       result.get("peers_share")),
                      (f" on seeds {common.get('seeds')}, every arm", common.get("peers_share"))):
        if ps:
            values = ", ".join(f"{v:+.1f}" for v in ps["values"])
            lines += ["", _interval(f"peers' share{label}: {ps['best_sharing_arm']} - {ps['strongest_baseline']}",
                                    ps, f" per seed {values}")]
    cm = result.get("compute_match")
    if cm and "trained_tokens_per_policy" in cm:
        seeds = ", ".join(f"{x:.2f}" for x in cm["trained_tokens_per_seed"])
        pols = ", ".join(f"{p} {v['mean']:.2f}" for p, v in cm["trained_tokens_per_policy"].items())
        flops = ", ".join(f"{p} {v['mean']:.2f}" for p, v in cm.get("flops_per_policy", {}).items())
        lines.append(f"compute: trained tokens x{cm['trained_tokens']:.2f} (per seed {seeds}; per policy {pols}), "
                     f"optimizer steps x{cm['optimizer_steps']:.2f}" + (f", FLOPs per policy {flops}" if flops else "")
                     + f"; every seed and policy within 10 %: {cm.get('every_seed_and_policy_within_10_percent')}")
    headline = result.get("peers_share") or {}
    if headline.get("inside_match") is False:
        lines.append(f"no baseline is inside the match of {headline['best_sharing_arm']} on every seed and policy: "
                     "the peers' share above is against the strongest baseline whatever its compute")
    anyc = result.get("peers_share_any_compute")
    if anyc and headline.get("inside_match") and anyc["strongest_baseline"] != headline.get("strongest_baseline"):
        values = ", ".join(f"{v:+.1f}" for v in anyc["values"])
        lines.append(_interval(f"peers' share against the strongest baseline whatever its compute: "
                               f"{anyc['best_sharing_arm']} - {anyc['strongest_baseline']}", anyc, f" per seed {values}"))
    for a, cmp in result.get("matched_sharing", {}).items():
        v = cmp["vs_strongest_baseline"]
        lines.append(_interval(f"compute-matched sharing {a} - {v['baseline']}", v,
                               f" (trained tokens x{cmp['compute_match']['trained_tokens']:.2f})"))
    for e, cmp in result.get("efficiency", {}).items():
        lines += [_interval(f"efficiency {e} {k} ({v['baseline']})", v) for k, v in cmp.items()]
    verdict = evidence.target_text(result.get("target"))
    if verdict:
        lines.append(f"target {verdict}")
    return lines


def print_table(result: Mapping[str, Any]) -> None:
    """Print :func:`table_lines` to stdout."""
    print("\n".join(table_lines(result)))
