"""The zoo lands in its band everywhere: default policies built with 1 and 2 torch threads and two
build seeds, each into a fresh cache.

    python benchmarks/zoo_bands.py [--quick] [--threads 1,2] [--seeds 0,1] [--configs 2:0,1:0,2:1] [--policies ...]

Per (policy, threads, build seed): SFT steps until landing, validation accuracy at landing, test
greedy and sampled accuracy per skill, whether the test accuracy is inside the band, build seconds.
Builds run one at a time. Writes ``benchmarks/results/zoo_bands.json`` (``--quick``: one policy,
one configuration; ``--name``: another result name).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from _common import git_rev, machine, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--name", default=None, help="result name (default zoo_bands / zoo_bands_quick)")
    ap.add_argument("--threads", default=None)
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--policies", default=None)
    ap.add_argument("--configs", default=None, help="THREADS:SEED pairs instead of the product of --threads "
                    "and --seeds, e.g. 2:0,1:0,2:1")
    args = ap.parse_args()

    import torch

    from mutualrl.zoo import DEFAULT_NAMES, ZOO, build_zoo, load_card
    from mutualrl.zoo.sft import ZooBandError

    policies = args.policies.split(",") if args.policies else (["llama-sub"] if args.quick else list(DEFAULT_NAMES))
    threads = [int(t) for t in (args.threads or ("2" if args.quick else "1,2")).split(",")]
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    rows = []
    configs = ([tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")] if args.configs
               else [(th, seed) for th in threads for seed in seeds])

    def write() -> None:  # after every build, so that an interrupted run keeps what it measured
        mach = machine()
        mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
        write_result(args.name or ("zoo_bands" + ("_quick" if args.quick else "")), {
            "builds": rows, "bands": {p: {k: list(v) for k, v in ZOO[p].bands.items()} for p in policies},
            "all_test_in_band": all(r["landed"] and all(r["test_in_band"].values()) for r in rows),
            "complete": len(rows) == len(policies) * len(configs),
            "machine": mach, "quick": args.quick, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
        })

    for pol in policies:
        for th, seed in configs:
            torch.set_num_threads(th)
            with tempfile.TemporaryDirectory() as cache:
                t = time.perf_counter()
                try:
                    d = build_zoo([pol], seed=seed, cache_dir=cache, progress=False, threads=th)[pol]
                    card = load_card(d)
                except ZooBandError as exc:  # a miss is a result: record it and go on
                    rows.append({"policy": pol, "threads": th, "build_seed": seed, "landed": False,
                                 "error": str(exc), "build_s": time.perf_counter() - t})
                    print(f"{pol:<10} threads {th} seed {seed}: MISSED its band: {exc}", flush=True)
                    write()
                    continue
            wall = time.perf_counter() - t
            bands = ZOO[pol].bands
            test = card["accuracy_greedy"]
            row = {"policy": pol, "threads": th, "build_seed": seed, "landed": True,
                   "sft_steps": card["sft_steps_done"], "sft_steering_checks": len(card.get("sft_steering", [])),
                   "val_at_landing": card["landed_val_accuracy"], "test_greedy": test,
                   "test_sampled_t1": card["accuracy_sampled_t1"],
                   "test_in_band": {k: bands[k][0] <= v <= bands[k][1] for k, v in test.items()},
                   "weights_sha256": card["weights_sha256"], "build_s": wall}
            rows.append(row)
            print(f"{pol:<10} threads {th} seed {seed}: {row['sft_steps']:>5} steps, test "
                  + ", ".join(f"{k} {v:.1%}{'' if row['test_in_band'][k] else ' (OUT)'}" for k, v in test.items())
                  + f", {wall:.0f}s", flush=True)
            write()


if __name__ == "__main__":
    main()
