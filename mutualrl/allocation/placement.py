"""One placement step: from a resolved plan, an MWRA allocation and a backend to a placed plan.

Every decision of where a worker runs is taken here and written into its
:class:`~mutualrl.resolve.WorkerSpec`: the device it computes on (as the worker itself names it),
the physical GPU its process is given (``CUDA_VISIBLE_DEVICES``), its share of that GPU, its torch
threads and CPU priority, its Ray node and core share, and the exchange URL it opens. Schedulers
realise a placed plan and decide nothing; a worker reads its spec and decides nothing.

Backends differ only in how a device is seen: ``local`` gives each worker process its own GPU
(seen as ``cuda:0``); ``ray`` lets the placement group's bundle do it (also ``cuda:0``); in
``sequential`` every worker lives in one process and names the physical device.

The memory shares of the worker processes on one GPU sum to at most 0.9
(:func:`~mutualrl.allocation.gpu_memory.memory_shares`): the rest is for their CUDA contexts.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

from mutualrl.allocation.gpu_memory import memory_shares
from mutualrl.allocation.planner import Allocation, Placement, Resources, plan_for
from mutualrl.config import RunConfig
from mutualrl.exchange.url import ExchangeURL
from mutualrl.resolve import RunPlan

BACKENDS: tuple[str, ...] = ("sequential", "local", "ray")


def physical_gpu(policy_device: str, run_device: str, planned: int | None) -> int | None:
    """The GPU a worker computes on, from the policy's device (or else the run's): ``cuda:N`` pins
    GPU ``N``; a plain ``cuda`` asks for a GPU and lets the plan decide which (the planned one, GPU 0
    where the plan has none); ``auto`` (both) follows the plan. None on the CPU (``cpu`` first wins)."""
    for d in (policy_device, run_device):
        if d == "cpu":
            return None
        if d == "cuda":
            return planned if planned is not None else 0
        if d.startswith("cuda:"):
            return int(d.split(":", 1)[1])
    return planned


def exchange_url(backend: str, cfg: RunConfig, run_dir: str | Path | None, scratch: str | Path | None = None,
                 nodes: int = 1) -> str:
    """The exchange every worker of the run opens.

    ``sqlite`` (the default) is the run directory's file; without a run directory, an in-memory
    store private to the run (sequential) or a file in ``scratch`` (worker processes must share
    it). A bare ``memory://`` likewise. On a Ray cluster of several nodes the run's store sits
    behind a ``ray://`` actor (backed by the run's file when there is a run directory). Any other
    URL is used as given.
    """
    ex = ExchangeURL.for_run(cfg.exchange, run_dir)
    if ex != ExchangeURL("memory", ""):
        if backend == "ray" and nodes > 1 and cfg.exchange == "sqlite":
            name = f"{Path(run_dir).name}-{uuid.uuid4().hex[:8]}"
            return f"ray://{name}?store={ex}"
        return str(ex)
    if backend == "sequential":
        return f"memory://run-{uuid.uuid4().hex}"  # one store for this run's workers, no earlier run's rows
    if backend == "ray" and nodes > 1:
        return f"ray://run-{uuid.uuid4().hex[:8]}"
    if scratch is None:
        raise ValueError(f"the {backend} backend without a run directory needs a scratch directory for its exchange")
    return str(ex.shared_by_processes(None, scratch))


def _device(backend: str, gpu: int | None) -> tuple[str, int | None]:
    """(the device the worker names, the physical GPU its process is given)."""
    if gpu is None:
        return "cpu", None
    if backend == "local":
        return "cuda:0", gpu
    if backend == "ray":
        return "cuda:0", None  # the bundle's GPU, which Ray makes the actor's only visible one
    return f"cuda:{gpu}", None


def place(plan: RunPlan, allocation: Allocation, backend: str, exchange: str, *, threads: int | None = None,
          rendezvous: str | None = None) -> RunPlan:
    """``plan`` with every worker placed as ``allocation`` says, for ``backend`` (see the module doc).

    ``threads`` fixes every worker's torch threads (the scheduler's or the run's ``threads``). The
    ranks of a policy on several workers take the planned threads each, split its core share, take consecutive
    GPUs from its planned one, and meet at ``rendezvous`` (``tcp://HOST:PORT``, the scheduler's
    store) under the policy's name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    cfg = plan.config
    specs = []
    for spec in plan.workers:  # a policy of ``workers: auto`` has the ranks the plan gives it
        n = allocation.placements[spec.index].ranks
        if cfg.policies[spec.index].workers == "auto" and n > 1 and backend != "sequential":
            specs.extend(dataclasses.replace(spec, rank=r, world=n) for r in range(n))
        else:
            specs.append(spec)
    workers = []
    gpus: list[tuple[str | None, int] | None] = []
    for spec in specs:
        pl: Placement = allocation.placements[spec.index]
        pol = cfg.policies[spec.index]
        gpu = physical_gpu(pol.device, cfg.device, pl.gpu)
        if gpu is not None and spec.world > 1:
            gpu += spec.rank
        device, visible = _device(backend, gpu)
        # a memory share is per process: workers sharing this process (sequential) cannot each have one
        share = pl.gpu_fraction if gpu is not None and 0 < pl.gpu_fraction < 1 and backend != "sequential" else None
        if spec.world > 1 and rendezvous is None:
            raise ValueError(f"policy {spec.name!r} has {spec.world} ranks: the {backend} backend needs a rendezvous")
        planned = max(1, pl.threads) if backend != "sequential" else None  # per rank already
        workers.append(dataclasses.replace(
            spec, device=device, visible_gpu=visible, gpu_fraction=share,
            threads=threads or cfg.threads or planned,
            nice=0 if backend == "sequential" else pl.nice, node=pl.node, cpu_share=pl.cpu_share / spec.world,
            exchange=exchange, rendezvous=f"{rendezvous}/{spec.name}" if spec.world > 1 else None))
        gpus.append((pl.node, gpu) if share is not None else None)
    # the processes on one GPU leave headroom for what the allocator does not see (CUDA contexts)
    shares = memory_shares([(g, w.gpu_fraction) for g, w in zip(gpus, workers, strict=True)])
    workers = [dataclasses.replace(w, gpu_fraction=s) for w, s in zip(workers, shares, strict=True)]
    return dataclasses.replace(plan, workers=tuple(workers), placed=True)


def place_in_process(plan: RunPlan, run_dir: str | Path | None = None) -> RunPlan:
    """The placement of a plan whose workers share this process (the sequential backend, or a
    worker built directly from a config): planned GPUs when there are any, the run's exchange."""

    if plan.placed:
        return plan
    return place(plan, plan_for(plan.config, Resources.detect()), "sequential",
                 exchange_url("sequential", plan.config, run_dir))
