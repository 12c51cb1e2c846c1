"""Zoo builds that land for every seed: the default zoo at build seeds 1-5 and the zoo of
``examples/zoo_taskmix.yaml`` at build seeds 1-3, each policy built into a fresh temporary folder.

    python benchmarks/zoo_builds.py [--seeds 1,2,3,4,5] [--taskmix-seeds 1,2,3] [--zoos default,taskmix]
                                    [--jobs 2] [--timeout 3600] [--name zoo_builds] [--dry-run] [--keep]
                                    [--set stall_patience=0 --set stall_restarts=0 ...] [--table]

Each build is ``build_zoo([policy], seed, cache_dir=<fresh temporary folder>, jobs=1, shipped=False)``
in a process of its own (one torch thread, as ``mutualrl zoo build`` builds each policy), ``--jobs``
of them at once (the issue's runs used ``zoo build --jobs 2`` on two cores). Per policy and seed:
``landed``, ``steps`` (of the attempt that landed or stopped last), ``steps_all_attempts`` (restarts
included), ``phase_steps``, ``attempts`` (init seeds, where each stalled), ``wall_s`` (the build's
process, end to end), ``build_s``/``sft_s``/``check_s`` (from the card), the validation accuracy per
skill where it landed or stopped (``val``), the test accuracy (``test_greedy``) and whether it lies in
the band, the error of a build that did not land, and the 1-minute load average before and after
the build. The file records the machine (CPU kind: model and vector flags; ``_common.machine``), the
git revision, the load average at the start and end, and a summary: ``all_landed``,
``max_wall_s``, the builds over 600 s. Written after every build, so an interrupted run keeps what
it measured. ``--dry-run`` prints the builds it would run and writes nothing. ``--set FIELD=VALUE``
(repeatable) changes a ``ZooSpec`` field of every policy built, for comparisons (e.g. the rule of
``ZOO_VERSION`` 7, no nudges and no restarts: ``--set stall_patience=0 --set stall_restarts=0
--set stall_checks=0 --name zoo_builds_v7rule``); the file records the changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from _common import RESULTS, git_rev, machine, write_result

SCRIPT = Path(__file__).resolve()
TASKMIX = SCRIPT.parent.parent / "examples" / "zoo_taskmix.yaml"
LIMIT_S = 600.0
"""The issue's bar: no build over 10 minutes per policy on the machine that filed it."""


def _zoo(zoo: str, changes: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """The specs (with ``changes``) and task of ``zoo`` (``default``: the embedded ones and the zoo
    task, None)."""
    import dataclasses

    from mutualrl.zoo import DEFAULT_NAMES, ZOO
    from mutualrl.zoo.cli import task_specs

    if zoo == "default":
        specs, task = {n: ZOO[n] for n in DEFAULT_NAMES}, None
    else:
        task, specs, _ = task_specs(TASKMIX)
    return {n: dataclasses.replace(s, **(changes or {})) for n, s in specs.items()}, task


def parse_set(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs (values as JSON, else strings) naming ``ZooSpec`` fields."""
    import dataclasses

    from mutualrl.zoo import ZooSpec

    fields = {f.name for f in dataclasses.fields(ZooSpec)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with a ZooSpec field ({', '.join(sorted(fields))})")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def child(job: dict[str, Any]) -> dict[str, Any]:
    """Build one policy into a fresh temporary folder (in this process); its row."""
    from mutualrl.zoo import build_zoo, load_card
    from mutualrl.zoo.sft import ZooBandError

    specs, task = _zoo(job["zoo"], job.get("set"))
    spec = specs[job["policy"]]
    row: dict[str, Any] = {**job, "bands": {k: list(v) for k, v in spec.bands.items()}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-build-") as cache:
        try:
            d = build_zoo([job["policy"]], seed=job["seed"], cache_dir=cache, progress=False, specs=specs, task=task,
                          jobs=1, shipped=False)[job["policy"]]
            card = load_card(d)
            if job.get("keep"):
                row["kept_at"] = str(keep(d, job["policy"], job["seed"], spec, task))
        except ZooBandError as exc:
            det = exc.details
            return {**row, "landed": False, "wall_s": time.perf_counter() - t0, "error": str(exc),
                    "steps": det.get("steps"), "steps_all_attempts": det.get("steps_all_attempts"),
                    "val": det.get("val"), "attempts": det.get("attempts"), "stall": det.get("stall")}
    test = card["accuracy_greedy"]
    return {**row, "landed": True, "wall_s": time.perf_counter() - t0, "steps": card["sft_steps_done"],
            "steps_all_attempts": card["sft_steps_all_attempts"], "phase_steps": card["sft_phase_steps"],
            "attempts": card["attempts"], "init_seed": card["init_seed"], "val": card["landed_val_accuracy"],
            "test_greedy": test, "test_sampled_t1": card["accuracy_sampled_t1"],
            "test_in_band": {k: spec.bands[k][0] <= v <= spec.bands[k][1] for k, v in test.items()},
            "build_s": card["build_s"], "sft_s": card["sft_s"], "check_s": card["sft_check_s"],
            "steering_checks": len(card["sft_steering"]), "lr_scale_final": card["sft_lr_scale_final"],
            "weights_sha256": card["weights_sha256"], "zoo_version": card["zoo_version"]}


def keep(built: Path, name: str, seed: int, spec: Any, task: Any) -> Path:
    """Copy a landed build into the zoo cache where ``build_zoo`` looks for it (the studies' fresh
    build per seed then loads it instead of building it again: the builds are deterministic per CPU
    kind, so the copy is the build they would make); a build there already is left as it is."""
    import shutil

    from mutualrl.zoo.build import is_built, policy_dir

    dest = policy_dir(name, seed, None, spec, task)
    if not is_built(dest):
        tmp = dest.with_name(dest.name + f".keep-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(built, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def run_child(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`child` in a process of its own; a crash or a timeout is a row too."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(SCRIPT), "--child", json.dumps(job)], capture_output=True, text=True,
                           check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**job, "landed": False, "error": f"timeout after {timeout:.0f} s", "wall_s": timeout,
                "load_avg_before": load, "load_avg_after": os.getloadavg()[0]}
    out = p.stdout.strip().splitlines()
    if p.returncode != 0 or not out:
        row = {**job, "landed": False, "error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}",
               "wall_s": time.perf_counter() - t0}
    else:
        row = json.loads(out[-1])
    return {**row, "load_avg_before": load, "load_avg_after": os.getloadavg()[0]}


def check(zoos: list[str], changes: dict[str, Any]) -> None:
    """Load each zoo's specs with ``changes`` and check them (``SystemExit`` with the reason)."""
    from mutualrl.errors import UserError

    for zoo in zoos:
        specs, task = _zoo(zoo, changes)
        try:
            for spec in specs.values():
                spec.check(list(task.train) if task is not None else ["add", "sub"])
        except UserError as exc:
            raise SystemExit(f"--set: {exc}") from None


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The builds to run: (zoo, seed, policy), the slower default zoo first."""
    seeds = {"default": [int(s) for s in args.seeds.split(",") if s],
             "taskmix": [int(s) for s in args.taskmix_seeds.split(",") if s]}
    names = {"default": ["gpt2-add", "llama-sub"], "taskmix": ["gpt2-x3", "llama-x4"]}
    return [{"zoo": z, "seed": s, "policy": n} for z in args.zoos.split(",") for s in seeds[z] for n in names[z]]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every build landed, the slowest, and the builds over :data:`LIMIT_S`."""
    walls = [r["wall_s"] for r in rows if "wall_s" in r]
    return {"all_landed": bool(rows) and all(r["landed"] for r in rows),
            "all_test_in_band": bool(rows) and all(r["landed"] and all(r["test_in_band"].values()) for r in rows),
            "max_wall_s": max(walls) if walls else None, "limit_s": LIMIT_S,
            "over_limit": [f"{r['zoo']} seed {r['seed']} {r['policy']}: {r['wall_s']:.0f} s" for r in rows
                           if r.get("wall_s", 0) > LIMIT_S]}


def table(result: dict[str, Any]) -> str:
    """docs/zoo.md's build table from a result file: one row per build."""
    cpu = result["machine"]["cpu"]["model"]
    head = ("| zoo | build seed | policy | landed | steps (all attempts) | restarts | wall | validation at landing "
            "| test greedy | CPU |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["builds"]:
        pct = lambda d: ", ".join(f"{k} {v:.1%}" for k, v in (d or {}).items()) or "—"
        restarts = max(0, len(r.get("attempts") or [None]) - 1)
        steps = f"{r['steps']:,} ({r['steps_all_attempts']:,})" if r.get("steps") else "—"
        landed = "yes" if r["landed"] else f"no ({(r.get('error') or '')[:60]})"
        test = pct(r.get("test_greedy"))
        if r["landed"] and not all(r["test_in_band"].values()):
            test += " (outside the band: " + ", ".join(k for k, ok in r["test_in_band"].items() if not ok) + ")"
        lines.append(f"| {r['zoo']} | {r['seed']} | `{r['policy']}` | {landed} | {steps} | {restarts} | "
                     f"{r['wall_s']:.0f} s | {pct(r.get('val'))} | {test} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4,5", help="build seeds of the default zoo (default 1,2,3,4,5)")
    ap.add_argument("--taskmix-seeds", default="1,2,3", help="build seeds of the taskmix zoo (default 1,2,3)")
    ap.add_argument("--zoos", default="default,taskmix", help="which zoos: default, taskmix or both")
    ap.add_argument("--jobs", type=int, default=2, help="builds at once, one process and one torch thread each")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one build may take (default 3600)")
    ap.add_argument("--name", default="zoo_builds", help="result name (benchmarks/results/NAME.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the builds and write nothing")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="change a ZooSpec field of every policy built (repeatable; value as JSON)")
    ap.add_argument("--keep", action="store_true",
                    help="copy each landed build into the zoo cache, where the studies' per-seed builds load it")
    ap.add_argument("--table", action="store_true",
                    help="print docs/zoo.md's build table from benchmarks/results/NAME.json and build nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.table:
        print(table(json.loads((RESULTS / f"{args.name}.json").read_text())))
        return
    unknown = set(args.zoos.split(",")) - {"default", "taskmix"}
    if unknown or args.jobs < 1:
        ap.error(f"--zoos takes default and/or taskmix (got {sorted(unknown)}); --jobs must be >= 1")
    changes = parse_set(args.set)
    jobs = [{**j, "set": changes} for j in plan(args)] if changes else plan(args)
    if args.keep and not changes:  # a build with changed specs is not the one a study loads
        jobs = [{**j, "keep": True} for j in jobs]
    check(args.zoos.split(","), changes)
    if args.dry_run:
        for j in jobs:
            print(f"{j['zoo']:8s} seed {j['seed']}  {j['policy']}")
        print(f"{len(jobs)} builds, {args.jobs} at once; would write benchmarks/results/{args.name}.json")
        return
    t0, load0, rows = time.perf_counter(), os.getloadavg()[0], []

    def write() -> None:
        mach = machine()
        mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
        write_result(args.name, {"builds": sorted(rows, key=lambda r: (r["zoo"], r["seed"], r["policy"])),
                                 "summary": summary(rows), "complete": len(rows) == len(jobs),
                                 "planned": jobs, "jobs": args.jobs, "set": changes, "machine": mach,
                                 "git_rev": git_rev(),
                                 "wall_s": time.perf_counter() - t0})

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for done in as_completed([pool.submit(run_child, j, args.timeout) for j in jobs]):
            row = done.result()
            rows.append(row)
            how = (f"landed: {row['steps_all_attempts']} steps, test "
                   + ", ".join(f"{k} {v:.1%}" for k, v in row["test_greedy"].items())) if row["landed"] else \
                f"MISSED: {row.get('error', '')[:300]}"
            print(f"{row['zoo']:8s} seed {row['seed']} {row['policy']:10s} {row['wall_s']:6.0f} s  {how}", flush=True)
            write()
    write()


if __name__ == "__main__":
    main()
