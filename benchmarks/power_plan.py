"""How many seeds each learning study needs for 80 % power, from the spread its committed runs show.

For each study (the zoo ``mutual``, the task mix ``mutual_taskmix``, the real pair
``mutual_real_small``) it takes the headline pair of the committed JSON (``peers_share``: the best
sharing arm and the strongest baseline), recomputes the per-seed paired differences on the
**validation** split from the committed records (``<name>_runs/``, :func:`mutualrl.study.evidence.paired`
with ``split="val"``) over the JSON's final seeds, and falls back to the test differences of
``peers_share.values`` only when the records hold no validation accuracy (the JSON says which was
used). With that sample sd taken as the true per-seed sd, it asks :mod:`mutualrl.study.power` for
the seeds a two-sided paired t test at 5 % needs for 80 % power at the study's target (+5 points on
the zoo and on real models, +3 on the task mix) and at the observed mean. The same figures on the
test differences are written beside them for comparison (test is not where a plan may look).

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

POWER, ALPHA = 0.8, 0.05


def differences(results: Path, name: str) -> dict[str, Any]:
    """The headline pair's per-seed differences of study ``name`` on validation (recomputed from its
    records) and on test (the JSON's ``peers_share``), with the split the plan uses."""
    study = json.loads((results / f"{name}.json").read_text())
    share = study["peers_share"]
    best, base = share["best_sharing_arm"], share["strongest_baseline"]
    seeds = study.get("declared_final_seeds") or share.get("seeds") or study.get("final_seeds")
    runs = [r for r in load_records(results / f"{name}_runs") if r["seed"] in seeds]
    val = evidence.paired(runs, best, base, split="val")
    test = {"seeds": share.get("seeds"), "values": share["values"], "mean": share["mean"], "sd": share["sd"]}
    use_val = val["n"] >= 2 and val["seeds"] == sorted(seeds)
    return {"same_start_on_every_seed": same_start(runs, best),"best_sharing_arm": best, "strongest_baseline": base, "final_seeds": sorted(seeds),
            "split_used": "val" if use_val else "test",
            "val": {k: val[k] for k in ("seeds", "values", "mean", "sd", "ci95")} if val["n"] else None,
            "test": test}


def same_start(runs: list[dict[str, Any]], arm: str) -> bool | None:
    """Whether ``arm``'s runs start from the same validation accuracy (step 0, every policy) on every
    seed: one zoo build for all seeds, so the spread leaves out what a fresh build per seed adds."""
    starts = {r["seed"]: tuple(sorted((e["policy"], e.get("val_acc")) for e in r["evals"] if e.get("step") == 0))
              for r in runs if r["arm"] == arm}
    return len(set(starts.values())) == 1 if len(starts) > 1 else None


def plan(results: Path = RESULTS) -> dict[str, Any]:
    """Every study's differences and plan rows (on the split used, and on test for comparison)."""
    out: dict[str, Any] = {}
    for name, target in STUDIES.items():
        d = differences(results, name)
        used = d[d["split_used"]]
        row = power.plan_row(name, used["sd"], target, used["mean"], POWER, ALPHA)
        on_test = power.plan_row(name, d["test"]["sd"], target, d["test"]["mean"], POWER, ALPHA)
        out[name] = {**d, "plan": row, "on_test_for_comparison": on_test}
    return out


def _n(x: int | None) -> str:
    return f"{x}" if x is not None else "> 200"


def print_table(studies: dict[str, Any]) -> None:
    """The plan as a plain table."""
    head = (f"{'study':<19}{'pair':<44}{'split':<6}{'n':>3}{'mean':>7}{'sd':>6}{'target':>8}"
            f"{'seeds@target':>14}{'seeds@mean':>12}{'power@5':>9}")
    print(head)
    for name, s in studies.items():
        for split, row in ((s["split_used"], s["plan"]), ("test", s["on_test_for_comparison"])):
            if split == "test" and s["split_used"] == "test":
                continue
            n = len(s[split]["values"])
            mean = f"{row['observed_mean']:+.2f}"
            print(f"{name:<19}{s['best_sharing_arm'] + ' - ' + s['strongest_baseline']:<44}{split:<6}{n:>3}"
                  f"{mean:>7}{row['observed_sd']:>6.2f}{row['target']:>+8.1f}{_n(row['seeds_at_target']):>14}"
                  f"{_n(row['seeds_at_observed_mean']):>12}{row['power_at_5_seeds_at_target']:>9.2f}")
    print("\nseeds@target / seeds@mean: paired seeds for 80 % power of a two-sided t test at 5 % with the observed "
          "sd as the true sd; power@5: the power 5 seeds have at the target.")


def main() -> None:
    start = time.time()
    studies = plan()
    print_table(studies)
    for name, s in studies.items():
        if s["split_used"] != "val":
            print(f"note: {name} has no validation accuracy on every final seed; its plan uses test")
        if s["same_start_on_every_seed"]:
            print(f"note: {name}'s seeds all start from the same step-0 validation accuracy (the same weights: "
                  "for a zoo, one build for every seed), so its spread leaves out what a fresh build per seed adds")
        if len(s["final_seeds"]) < 5:
            print(f"note: {name}'s sd comes from {len(s['final_seeds'])} seeds only: a very rough estimate")
        v = s["val"]
        if v and v["seeds"] == s["test"]["seeds"] and len(v["values"]) > 2:  # per-seed differences, val against test
            s["val_test_correlation"] = statistics.correlation(v["values"], s["test"]["values"])
    write_result("power_plan", {"studies": studies, "power": POWER, "alpha": ALPHA, "targets": STUDIES,
                                "method": "per study: the headline pair (peers_share's best sharing arm and strongest "
                                          "baseline) paired per final seed on validation, recomputed from the "
                                          "committed records; the observed sample sd taken as the true sd; power of a "
                                          "two-sided one-sample t test at alpha from the noncentral t "
                                          "(mutualrl.study.power, no scipy)",
                                "machine": machine(), "git_rev": git_rev(), "quick": False, "wall_s": time.time() - start})


if __name__ == "__main__":
    main()
