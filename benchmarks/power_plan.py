"""How many seeds each learning study needs for 80 % power, from the spread its first protocol's
committed runs show (the figures the pre-registered plan in ``benchmarks/README.md`` cites).

For each study (the zoo ``mutual``, the task mix ``mutual_taskmix``, the real pair
``mutual_real_small``) it reads the first protocol's JSON (``<name>_protocol1.json``, the archive,
when it exists, else ``<name>.json``: a plan is made before the new protocol's seeds run, so a rerun
must not read them) and takes its headline pair (``peers_share``: the best sharing arm and the
strongest baseline). It recomputes the per-seed paired differences on the **validation** split from
the committed records beside it (``<source>_runs/``, :func:`mutualrl.study.evidence.paired` with
``split="val"``) over the JSON's final seeds, and falls back to the test differences of
``peers_share.values`` only when the records hold no validation accuracy on every final seed (the
JSON says which split was used). With that sample sd taken as the true per-seed sd, it asks
:mod:`mutualrl.study.power` for the seeds a two-sided paired t test at 5 % needs for 80 % power at
the study's target (+5 points on the zoo and on real models, +3 on the task mix) and at the observed
mean. The same figures on the test differences are written beside them for comparison.

Two stand-ins the plan uses are computed too (``stand_ins``): the zoo at +5 with the task mix's
validation sd (the zoo's own spread came from one build for every seed), and the real pair at +5
with the test sd of its second stage's three seeds and of both stages' six seeds (its validation
split was not distributed like test).

Reads JSON only (no training, seconds):

    python benchmarks/power_plan.py

Prints a table and writes ``benchmarks/results/power_plan.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, git_rev, machine, write_result

from mutualrl.study import evidence, power
from mutualrl.study.records import load_records

STUDIES: dict[str, float] = {"mutual": 5.0, "mutual_taskmix": 3.0, "mutual_real_small": 5.0}
"""Each study's target for the peers' share, in points (issue 53)."""
REAL_STAGE2 = "mutual_real_small_stage2"
"""The real pair's second stage (fresh seeds 3-5), for the six-seed spread."""

POWER, ALPHA = 0.8, 0.05


def source(results: Path, name: str) -> str:
    """The first protocol's JSON of study ``name``: its archive ``<name>_protocol1`` when there is one,
    else ``<name>``; FileNotFoundError when neither is."""
    for candidate in (f"{name}_protocol1", name):
        if (results / f"{candidate}.json").is_file():
            return candidate
    raise FileNotFoundError(f"neither {name}_protocol1.json nor {name}.json in {results}")


def same_start(runs: list[dict[str, Any]], arm: str) -> bool | None:
    """Whether ``arm``'s runs start from the same validation accuracy (step 0, every policy) on every
    seed: the same weights (for a zoo, one build for all seeds), so the spread leaves out what a
    fresh build per seed adds."""
    starts = {r["seed"]: tuple(sorted((e["policy"], e.get("val_acc")) for e in r["evals"] if e.get("step") == 0))
              for r in runs if r["arm"] == arm}
    return len(set(starts.values())) == 1 if len(starts) > 1 else None


def differences(results: Path, name: str) -> dict[str, Any]:
    """The headline pair's per-seed differences of study ``name`` (its first protocol's JSON) on
    validation (recomputed from its records) and on test (the JSON's ``peers_share``), with the split
    the plan uses."""
    src = source(results, name)
    study = json.loads((results / f"{src}.json").read_text())
    share = study["peers_share"]
    best, base = share["best_sharing_arm"], share["strongest_baseline"]
    seeds = sorted(study.get("declared_final_seeds") or share.get("seeds") or study.get("final_seeds"))
    runs = [r for r in load_records(results / f"{src}_runs") if r["seed"] in seeds]
    val = evidence.paired(runs, best, base, split="val")
    test = {"seeds": share.get("seeds"), "values": share["values"], "mean": share["mean"], "sd": share["sd"]}
    use_val = val["n"] >= 2 and val["seeds"] == seeds
    return {"source": f"{src}.json", "best_sharing_arm": best, "strongest_baseline": base, "final_seeds": seeds,
            "same_start_on_every_seed": same_start(runs, best), "split_used": "val" if use_val else "test",
            "val": {k: val[k] for k in ("seeds", "values", "mean", "sd", "ci95")} if val["n"] else None,
            "test": test}


def plan(results: Path = RESULTS) -> dict[str, Any]:
    """Every study's differences and plan rows (on the split used, and on test for comparison)."""
    out: dict[str, Any] = {}
    for name, target in STUDIES.items():
        d = differences(results, name)
        used = d[d["split_used"]]
        row = power.plan_row(name, used["sd"], target, used["mean"], POWER, ALPHA)
        on_test = power.plan_row(name, d["test"]["sd"], target, d["test"]["mean"], POWER, ALPHA)
        out[name] = {**d, "plan": row, "on_test_for_comparison": on_test}
        if d["val"] and d["val"]["seeds"] == d["test"]["seeds"] and len(d["val"]["values"]) > 2:
            out[name]["val_test_correlation"] = statistics.correlation(d["val"]["values"], d["test"]["values"])
    return out


def stand_ins(results: Path, studies: dict[str, Any]) -> dict[str, Any]:
    """The plan rows that borrow a spread: the zoo at its target with the task mix's validation sd,
    and the real pair with the test sd of its second stage and of both stages together."""
    out: dict[str, Any] = {}
    mix = studies.get("mutual_taskmix")
    if mix and mix["val"]:
        out["mutual_with_taskmix_val_sd"] = power.plan_row("mutual", mix["val"]["sd"], STUDIES["mutual"], None,
                                                           POWER, ALPHA)
    real = studies.get("mutual_real_small")
    if real and (results / f"{REAL_STAGE2}.json").is_file():
        stage2 = json.loads((results / f"{REAL_STAGE2}.json").read_text())["peers_share"]
        both = [*real["test"]["values"], *stage2["values"]]
        for key, values in (("mutual_real_small_stage2_test_sd", stage2["values"]),
                            ("mutual_real_small_both_stages_test_sd", both)):
            row = power.plan_row("mutual_real_small", statistics.stdev(values), STUDIES["mutual_real_small"],
                                 statistics.fmean(values), POWER, ALPHA)
            out[key] = {**row, "values": values}
    return out


def _n(x: int | None) -> str:
    return f"{x}" if x is not None else "> 200"


def _line(name: str, pair: str, split: str, n: int, row: dict[str, Any]) -> str:
    mean = f"{row['observed_mean']:+.2f}" if row["observed_mean"] is not None else "-"
    return (f"{name:<38}{pair:<44}{split:<6}{n:>3}{mean:>7}{row['observed_sd']:>6.2f}{row['target']:>+8.1f}"
            f"{_n(row['seeds_at_target']):>14}{_n(row['seeds_at_observed_mean']) if row['observed_mean'] else '-':>12}"
            f"{row['power_at_5_seeds_at_target']:>9.2f}")


def print_table(studies: dict[str, Any], borrowed: dict[str, Any]) -> None:
    """The plan as a plain table."""
    print(f"{'study':<38}{'pair':<44}{'split':<6}{'n':>3}{'mean':>7}{'sd':>6}{'target':>8}{'seeds@target':>14}"
          f"{'seeds@mean':>12}{'power@5':>9}")
    for name, s in studies.items():
        pair = f"{s['best_sharing_arm']} - {s['strongest_baseline']}"
        print(_line(name, pair, s["split_used"], len(s[s["split_used"]]["values"]), s["plan"]))
        if s["split_used"] != "test":
            print(_line(name, pair, "test", len(s["test"]["values"]), s["on_test_for_comparison"]))
    for key, row in borrowed.items():
        n = len(row.get("values", [])) or len(studies["mutual_taskmix"]["val"]["values"])
        print(_line(key, "(borrowed spread)", "val" if "val" in key else "test", n, row))
    print("\nseeds@target / seeds@mean: paired seeds for 80 % power of a two-sided t test at 5 % with the observed "
          "sd as the true sd; power@5: the power 5 seeds have at the target.")


def main() -> None:
    start = time.time()
    studies = plan()
    borrowed = stand_ins(RESULTS, studies)
    print_table(studies, borrowed)
    for name, s in studies.items():
        print(f"{name}: read {s['source']}")
        if s["split_used"] != "val":
            print(f"note: {name} has no validation accuracy on every final seed; its plan uses test")
        if s["same_start_on_every_seed"]:
            print(f"note: {name}'s seeds all start from the same step-0 validation accuracy (the same weights: "
                  "for a zoo, one build for every seed; for released models, as expected), so its spread leaves out "
                  "what a fresh build per seed adds")
        if len(s["final_seeds"]) < 5:
            print(f"note: {name}'s sd comes from {len(s['final_seeds'])} seeds only: a very rough estimate")
    write_result("power_plan", {"studies": studies, "stand_ins": borrowed, "power": POWER, "alpha": ALPHA,
                                "targets": STUDIES,
                                "method": "per study: the first protocol's headline pair (peers_share's best sharing "
                                          "arm and strongest baseline) paired per final seed on validation, "
                                          "recomputed from the committed records; the observed sample sd taken as "
                                          "the true sd; power of a two-sided one-sample t test at alpha from the "
                                          "noncentral t (mutualrl.study.power, no scipy)",
                                "machine": machine(), "git_rev": git_rev(), "quick": False,
                                "wall_s": time.time() - start})


if __name__ == "__main__":
    main()
