"""One placement step: from a resolved plan, an MWRA allocation and a backend to a placed plan.

Every decision of where a worker runs is taken here and written into its
:class:`~mutualrl.config.resolve.WorkerSpec`: the device it computes on (as the worker itself names it),
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
from mutualrl.allocation.memory_plan import PolicyMemory, plan_memory
from mutualrl.allocation.planner import Allocation, Placement, Resources, plan_for
from mutualrl.config import RunConfig
from mutualrl.config.resolve import RunPlan, WorkerSpec
from mutualrl.exchange.url import ExchangeURL

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
          rendezvous: str | None = None, memory_of: RunPlan | None = None) -> RunPlan:
    """``plan`` with every worker placed as ``allocation`` says, for ``backend`` (see the module doc).

    ``threads`` fixes every worker's torch threads (the scheduler's or the run's ``threads``). The
    ranks of a policy on several workers take the planned threads each, split its core share, take consecutive
    GPUs from its planned one, and meet at ``rendezvous`` (``tcp://HOST:PORT``, the scheduler's
    store) under the policy's name. Memory is priced for a first placement; a re-plan passes the
    placed plan in force as ``memory_of`` and keeps its workers' memory, micro-batch budgets and
    vLLM shares (the workers run with those; a re-plan moves threads only)."""
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
    if memory_of is not None:
        kept = {(w.index, w.rank): w for w in memory_of.workers}
        workers = [dataclasses.replace(w, **{f: getattr(kept[(w.index, w.rank)], f) for f in MEMORY_FIELDS})
                   if (w.index, w.rank) in kept else w for w in workers]
    else:
        workers = _with_memory(plan, allocation, workers, backend)
    return dataclasses.replace(plan, workers=tuple(workers), placed=True)


MEMORY_FIELDS: tuple[str, ...] = ("memory_bytes", "micro_batch_tokens", "predicted_peak_bytes", "predicted_resident_bytes",
                                  "vllm_memory_fraction")
"""What the memory plan writes into a worker's spec."""


def _gpu_bytes(allocation: Allocation, node: str | None, gpu: int | None) -> int | None:
    """The memory of the GPU a worker is given (None on the CPU; 80 GiB when the plan does not know it)."""
    if gpu is None:
        return None
    pool = next((n.gpus for n in allocation.resources.nodes if n.node_id == node), None) or allocation.resources.gpus
    dev = next((g for g in pool if g.index == gpu), None)
    return int((dev.memory_gb if dev is not None else 80.0) * 2**30)


def memory_entries(plan: RunPlan, allocation: Allocation, backend: str) -> list[PolicyMemory]:
    """Each policy's memory in a placed plan (its workers placed by ``allocation`` for ``backend``):
    :func:`~mutualrl.allocation.memory.plan_memory`, which raises
    :class:`~mutualrl.allocation.memory.MemoryPlanError` for a policy that cannot fit."""
    first = {w.index: w for w in reversed(plan.workers)}
    k = len(plan.config.policies)
    gpu_bytes = [_gpu_bytes(allocation, first[i].node, _physical(first[i])) if first[i].device != "cpu" else None
                 for i in range(k)]
    return plan_memory(plan, gpu_bytes, [first[i].world for i in range(k)], concurrent=backend != "sequential",
                       shares=[first[i].gpu_fraction for i in range(k)],
                       act_bytes_per_token=allocation.act_bytes_per_token,
                       gpu_ids=[(first[i].node, _physical(first[i])) for i in range(k)])


def _with_memory(plan: RunPlan, allocation: Allocation, workers: list[WorkerSpec], backend: str) -> list[WorkerSpec]:
    """Every worker with the memory the plan gives it, its micro-batch budget and its predicted peak."""
    entries = memory_entries(dataclasses.replace(plan, workers=tuple(workers)), allocation, backend)
    return [dataclasses.replace(w, memory_bytes=entries[w.index].allowance,
                                micro_batch_tokens=entries[w.index].micro_batch_tokens,
                                predicted_peak_bytes=entries[w.index].predicted_peak,
                                predicted_resident_bytes=entries[w.index].predicted_resident,
                                vllm_memory_fraction=entries[w.index].vllm_memory_fraction) for w in workers]


def _physical(spec: WorkerSpec) -> int | None:
    """The physical GPU of a placed worker (its visible GPU, or the index its device names)."""
    if spec.visible_gpu is not None:
        return spec.visible_gpu
    if spec.device and spec.device.startswith("cuda"):
        return int(spec.device.split(":")[1]) if ":" in spec.device else 0
    return None


def place_in_process(plan: RunPlan, run_dir: str | Path | None = None) -> RunPlan:
    """The placement of a plan whose workers share this process (the sequential backend, or a
    worker built directly from a config): planned GPUs when there are any, the run's exchange."""

    if plan.placed:
        return plan
    return place(plan, plan_for(plan.config, Resources.detect()), "sequential",
                 exchange_url("sequential", plan.config, run_dir))
