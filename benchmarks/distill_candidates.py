"""``distill`` on validation under the study protocol: the dense-signal candidates of a study's tuning
seed against the current best (``imitate`` with replay) and the strongest single-model control, per
policy and per task type, with trained tokens and FLOPs split into sampling, scoring and update.

    python benchmarks/distill_candidates.py [--study mutual] [--seed 0] [--write]

Reads the committed records of the study's tuning seed (``benchmarks/results/<study>_runs/``: every
candidate the plan tuned ran there), no training, seconds. Arms are grouped by what they are: the
``distill`` candidates (every arm whose strategy holds ``distill``), the best ``imitate``-with-replay
arm without it, and per single-model family (tuned GRPO ``independent*``, ``self_imitate*``, the
compute-matched control ``matched*``) its best on validation; the strongest of those three families
is marked. Validation only: the test split is the evidence study's, read once by its final seeds.
``--write`` writes ``benchmarks/results/<study>_distill_candidates.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from _common import RESULTS, write_result

from mutualrl.study import evidence
from mutualrl.study.records import load_records

FAMILIES = (("independent", "tuned GRPO"), ("self_imitate", "self_imitate"), ("matched", "matched control"))
"""The single-model families, by arm-name prefix, and how the table names them."""


def final_eval(run: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy, its last evaluation's validation accuracy in all (``all``) and per task type."""
    return evidence.final_per_policy(run, "val")


def summarise(run: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """One candidate's row: validation (the mean over policies, per policy and type), compute per policy."""
    val = final_eval(run)
    spent = evidence.compute_by_policy(run)
    return {"arm": run["arm"], "kind": kind, "strategy": run.get("strategy"), "seed": run["seed"],
            "git_rev": run.get("git_rev"), "val": statistics.fmean(v["all"] for v in val.values()),
            "per_policy": {p: {"val": v, "trained_tokens": spent.get(p, {}).get("trained_tokens"),
                               "flops": {ph: spent[p][f"flops_{ph}"] for ph in ("sampling", "scoring", "update")
                                         if f"flops_{ph}" in spent.get(p, {})}}
                           for p, v in val.items()}}


def candidates(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the table, in order: the single-model families' best (the strongest marked), the
    best ``imitate`` with replay, then every ``distill`` candidate."""
    def best(rs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        scored = [r for r in rs if final_eval(r)]
        return max(scored, key=lambda r: statistics.fmean(v["all"] for v in final_eval(r).values())) if scored else None

    rows = []
    for prefix, kind in FAMILIES:
        b = best([r for r in runs if r["arm"].startswith(prefix)])
        if b is not None:
            rows.append(summarise(b, kind))
    if rows:
        top = max(rows, key=lambda r: r["val"])
        top["kind"] += ", the strongest single-model arm"
    replay = best([r for r in runs if r["arm"].startswith("imitate_replay") and "distill" not in r["arm"]])
    if replay is not None:
        rows.append(summarise(replay, "imitate with replay, the best without distill"))
    rows += [summarise(r, "distill candidate") for r in sorted(runs, key=lambda r: r["arm"])
             if "distill" in str(r.get("strategy", "")) and final_eval(r)]
    return rows


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table: validation, per policy its types, trained tokens a run and FLOPs
    of scoring / in all."""
    policies = list(rows[0]["per_policy"]) if rows else []
    head = ["arm", "validation"] + [f"{p}: " + " / ".join(t for t in rows[0]["per_policy"][p]["val"] if t != "all")
                                    for p in policies]
    head += [f"{p}: trained tokens, FLOPs scoring / all" for p in policies]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['arm']}` ({r['kind']})", f"{100 * r['val']:.1f} %"]
        for p in policies:
            v = r["per_policy"].get(p, {}).get("val", {})
            cells.append(" / ".join(f"{100 * x:.1f}" for t, x in v.items() if t != "all"))
        for p in policies:
            pp = r["per_policy"].get(p, {})
            f = pp.get("flops", {})
            total = sum(f.values()) if f else None
            cells.append(f"{pp.get('trained_tokens') or 0:,.0f}, " + (f"{f.get('scoring', 0):.1e} / {total:.1e}"
                                                                        if total else "n/a"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mutual", help="the study whose tuning records are read (mutual, "
                    "mutual_taskmix, mutual_real_small)")
    ap.add_argument("--seed", type=int, default=0, help="the tuning seed")
    ap.add_argument("--write", action="store_true", help="write results/<study>_distill_candidates.json")
    args = ap.parse_args(argv)
    runs_dir = RESULTS / f"{args.study}_runs"
    runs = [r for r in load_records(runs_dir) if r["seed"] == args.seed] if runs_dir.is_dir() else []
    rows = candidates(runs)
    if not any(r["kind"] == "distill candidate" for r in rows):
        print(f"--study {args.study}: no distill candidate among the records of seed {args.seed} in {runs_dir}: "
              "run the study's tuning phase first", file=sys.stderr)
        return 2
    print(markdown(rows))
    if args.write:
        write_result(f"{args.study}_distill_candidates", {
            "study": args.study, "seed": args.seed, "split": "validation", "rows": rows,
            "source": f"benchmarks/results/{args.study}_runs/ (the tuning seed's records)",
            "command": f"python benchmarks/distill_candidates.py --study {args.study} --seed {args.seed} --write"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
