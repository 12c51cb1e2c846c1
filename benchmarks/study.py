"""Re-aggregate a committed benchmark study from its records: the studies of ``mutual.py``,
``mutual_taskmix.py`` and ``mutual_real_small.py`` keep every run's compact record in
``benchmarks/results/<study>_runs/`` and their figures in ``benchmarks/results/<study>.json``.

    python benchmarks/study.py aggregate mutual [--arms A,B] [--seeds 0,1,2] [--target 5] [--write]

The protocol itself (arms, tuning on validation, paired intervals, compute match, records,
re-aggregation) is the library's: :mod:`mutualrl.study` (``mutualrl study STUDY.yaml`` runs one on
your own task). ``--write`` replaces the committed JSON's figures with the new aggregation (the
study run's tuning, notes and machine kept, a note added), e.g. after runs of a further seed.
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import RESULTS, target_points

from mutualrl.study.aggregate import (
    aggregate,
    committed_arms,
    committed_final_seeds,
    committed_target,
    print_table,
    rewrite,
)


def _arms(name: str, arms: str | None) -> list[str] | None:
    """``--arms`` as a list; else the arms the committed result of ``name`` reports; else None (all)."""
    if arms:
        return [a.strip() for a in arms.split(",") if a.strip()]
    return committed_arms(RESULTS, name)


def _seeds(name: str, seeds: str | None) -> list[int] | None:
    """``--seeds`` as a list; else the final seeds the committed result of ``name`` declared; else None
    (the longest seed list an arm holds)."""
    if seeds:
        return [int(s) for s in seeds.split(",") if s.strip()]
    declared = committed_final_seeds(RESULTS, name)
    if declared is None:
        print(f"{name}: no committed JSON declares its final seeds; taking the longest seed list an arm holds, "
              "which may include the tuning seed and every tuning candidate: pass --seeds (and --arms) for the "
              "final round alone", file=sys.stderr)
    return declared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    ag = sub.add_parser("aggregate", help="re-aggregate a study's JSON from its committed compact runs")
    ag.add_argument("name")
    ag.add_argument("--arms", default=None,
                    help="comma-separated arms to aggregate (default: those of the committed results/<name>.json, "
                    "else every recorded arm, tuning candidates included)")
    ag.add_argument("--seeds", default=None,
                    help="comma-separated final seeds (default: those the committed results/<name>.json declared, "
                    "else the longest seed list an arm holds)")
    ag.add_argument("--target", type=target_points, default=None,
                    help="the plan's target for the peers' share, in points (default: the committed JSON's, if any)")
    ag.add_argument("--write", action="store_true",
                    help="replace the figures of results/<name>.json with this aggregation (the study run's "
                    "tuning, notes and machine kept; a note added)")
    args = ap.parse_args()
    if args.cmd != "aggregate":
        ap.print_help()
        return
    target = args.target if args.target is not None else committed_target(RESULTS, args.name)
    result = aggregate(RESULTS, args.name, _arms(args.name, args.arms), _seeds(args.name, args.seeds), target)
    if args.write:
        result = rewrite(RESULTS, args.name, result, seeds_given=bool(args.seeds),
                         how=f"python benchmarks/study.py aggregate {args.name} --write")
    print_table(result)
    print(json.dumps({k: result[k] for k in ("peers_share", "efficiency", "compute_match", "target") if k in result},
                     indent=1))


if __name__ == "__main__":
    main()
