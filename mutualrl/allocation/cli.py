"""``mutualrl plan CONFIG.yaml``: print the MWRA allocation of a run without training."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from mutualrl.allocation.memory_plan import describe_memory
from mutualrl.commands import subcommand
from mutualrl.errors import UserError

if TYPE_CHECKING:
    from mutualrl.allocation.cost import CostModel
    from mutualrl.allocation.planner import Allocation, Resources
    from mutualrl.config import RunConfig


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = subcommand(sub, cmd_plan, "print the MWRA resource plan of a config (no training)")
    p.add_argument("config", help="YAML run config")
    p.add_argument("--resources", help="plan for these instead of this machine: cpus=N[,gpus=NxGiB]")
    p.add_argument("--ray", action="store_true", help="plan for the Ray cluster (RAY_ADDRESS or a local one)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--calibrate", type=int, nargs="?", const=3, default=None, metavar="STEPS",
                   help="first time STEPS (default 3; the first is a warm-up) real steps and plan from those "
                   "measurements instead of the FLOP prior: on this machine's cores, the whole run as the prior "
                   "plan places it (every rank of every policy at once, in worker processes, on a private "
                   "exchange); with --ray or --resources, each policy alone in this process as one of its "
                   "ranks runs (loads every model; minutes for real models); skipped on GPUs, whose split is "
                   "planned from the prior")


def cmd_plan(args: argparse.Namespace) -> int:
    """Predict each policy's per-step cost from parameters x tokens and print how the workers would
    share this machine (or the given resources, or a Ray cluster), and each worker's predicted peak
    memory with the micro-batch budget that fits it. A plan that cannot fit in memory exits 2,
    naming the policy, the bytes and the levers."""
    from mutualrl.allocation.cost import CostModel, estimate_parameters
    from mutualrl.allocation.placement import memory_entries, place
    from mutualrl.allocation.planner import plan
    from mutualrl.config.resolve import resolve

    run_plan = resolve(args.config, check_paths=False)
    cfg = run_plan.config
    resources, started = _resources(args)
    try:
        costs = CostModel(cfg, estimate_parameters(cfg),
                          settings=[run_plan.spec(i).sharing for i in range(len(cfg.policies))])
        alloc = plan(cfg, resources, costs)
        if args.calibrate is not None:
            alloc = _calibrated(args, cfg, resources, costs, alloc)
        # every worker's bytes (a plan that cannot fit is refused here: exit 2, naming the policy)
        backend = "ray" if args.ray else cfg.scheduler
        placed = place(run_plan, alloc, backend, "memory://plan", rendezvous="tcp://127.0.0.1:1")
        mem = memory_entries(placed, alloc, backend)
        if args.json:
            print(json.dumps({"plan": alloc.to_dict(), "costs": costs.to_dict(),
                              "memory": [e.to_dict() for e in mem]}, indent=1))
        else:
            print(alloc.describe())
            print(describe_memory(mem))
            unknown = [p.name for p, n in zip(cfg.policies, costs.params, strict=True) if not n]
            if unknown:
                print(f"note: parameter count unknown offline for {', '.join(unknown)}; assumed the mean")
    finally:
        if started:
            import ray

            ray.shutdown()
    return 0


def _resources(args: argparse.Namespace) -> tuple[Resources, bool]:
    """What to plan for (``--ray``, ``--resources`` or this machine), and whether Ray was started here."""
    from mutualrl.allocation.planner import Resources

    if args.ray:
        from mutualrl.allocation.ray_scheduler import connect_ray

        started = connect_ray()
        return Resources.from_ray(), started
    if args.resources:
        try:
            return Resources.parse(args.resources), False
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return Resources.detect(), False


def _calibrated(args: argparse.Namespace, cfg: RunConfig, resources: Resources, costs: CostModel,
                alloc: Allocation) -> Allocation:
    """``--calibrate``: time ``args.calibrate`` real steps into ``costs``; the plan made from them."""
    from mutualrl.allocation.calibrate import calibrate, calibrate_in_workers
    from mutualrl.allocation.planner import plan

    if args.calibrate < 1:
        raise UserError(f"--calibrate takes a positive number of steps, got {args.calibrate}")
    say = lambda m: print(m, file=sys.stderr, flush=True)
    if resources.gpus:  # as a run does: the GPU planners price from the prior's per-device speed, so CPU
        # seconds measured here would come out scaled by it
        say("--calibrate: skipped on GPUs (the GPU split is planned from the FLOP prior; a run re-plans "
            "threads once its steps are measured)")
        return alloc
    if args.ray or args.resources:  # not this machine's cores: each policy alone here
        calibrate(cfg, costs, steps=args.calibrate, threads=[p.threads for p in alloc.placements],
                  ranks=[p.ranks for p in alloc.placements], say=say)
    else:  # the run as this plan places it on this machine's worker processes
        calibrate_in_workers(cfg, costs, alloc, steps=args.calibrate, say=say)
    return plan(cfg, resources, costs)
