"""MWRA planner: split the machine (or a Ray cluster) between policy workers.

Objective: in a synchronous step every worker waits for the slowest, so the planner minimises
the largest predicted busy time. On CPUs a worker gets a *share* of cores proportional to its
cost (shares solved so that the predicted times under Amdahl's law are equal), realised as an
integer number of torch threads (at least one) plus, when shares are fractional, a lower CPU
priority (``nice``) for the worker whose threads should get less than a whole core each. On GPUs
a worker gets a whole device when there are enough, otherwise a fraction of one (devices packed
by predicted load within their memory). On a Ray cluster workers are first spread over nodes,
then each node's CPUs are split as above.

Rollout and update of one policy stay *colocated* in its worker (one copy of the weights; the
step's rollout and update are sequential anyway).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mutualrl.allocation.cost import (
    PRIOR_CORE_S_PER_FLOP,
    PRIOR_GPU_S_PER_FLOP,
    CostModel,
    estimate_parameters,
)
from mutualrl.allocation.data_parallel import (
    GPU_ALLREDUCE_GB_S,
    allreduce_seconds,
    fixed_ranks,
    split_devices,
)
from mutualrl.allocation.shares import balanced_shares, realised_shares, shares_to_threads
from mutualrl.config import RunConfig
from mutualrl.errors import ConfigError


@dataclass
class GPUDevice:
    """One accelerator: its index on its node and memory in GiB."""

    index: int
    memory_gb: float
    name: str = ""


@dataclass
class NodeResources:
    """One node of a Ray cluster."""

    node_id: str
    cpus: float
    gpus: list[GPUDevice] = field(default_factory=list)
    custom: dict[str, float] = field(default_factory=dict)
    address: str = ""


@dataclass
class Resources:
    """What the planner may hand out: CPU cores, GPUs, and (on Ray) the nodes holding them."""

    cpus: float
    gpus: list[GPUDevice] = field(default_factory=list)
    nodes: list[NodeResources] = field(default_factory=list)

    @classmethod
    def detect(cls) -> Resources:
        """This machine: the cores this process may run on and the visible CUDA devices."""
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            cpus = os.cpu_count() or 1
        gpus: list[GPUDevice] = []
        try:
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    prop = torch.cuda.get_device_properties(i)
                    gpus.append(GPUDevice(i, prop.total_memory / 2**30, prop.name))
        except Exception:  # noqa: BLE001 - no usable CUDA: CPU only
            gpus = []
        return cls(float(cpus), gpus)

    @classmethod
    def from_ray(cls) -> Resources:
        """The alive nodes of the connected Ray cluster (``ray.init`` must have been called)."""
        import ray

        nodes = []
        for n in ray.nodes():
            if not n.get("Alive", n.get("alive", False)):
                continue
            res = dict(n.get("Resources", {}))
            n_gpu = int(res.pop("GPU", 0))
            gpu_mem = 0.0
            gpus = [GPUDevice(i, gpu_mem) for i in range(n_gpu)]
            custom = {k: v for k, v in res.items()
                      if k not in ("CPU", "memory", "object_store_memory") and not k.startswith("node:")}
            nodes.append(NodeResources(n["NodeID"], float(res.get("CPU", 0.0)), gpus, custom,
                                       n.get("NodeManagerAddress", "")))
        nodes.sort(key=lambda n: n.node_id)
        return cls(sum(n.cpus for n in nodes), [g for n in nodes for g in n.gpus], nodes)

    @classmethod
    def parse(cls, spec: str) -> Resources:
        """From text such as ``cpus=8``, ``cpus=16,gpus=2x80`` (GPUs x GiB) or ``cpus=4,gpus=1``."""
        cpus = float(os.cpu_count() or 1)
        gpus: list[GPUDevice] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, val = part.partition("=")
            if key == "cpus":
                cpus = float(val)
            elif key == "gpus":
                count, _, mem = val.partition("x")
                gpus = [GPUDevice(i, float(mem or 80)) for i in range(int(count))]
            else:
                raise ValueError(f"unknown resource {key!r} in {spec!r}: expected cpus=N and/or gpus=NxGiB")
        if cpus <= 0:
            raise ValueError(f"cpus must be > 0 in {spec!r}")
        return cls(cpus, gpus)

    def describe(self) -> str:
        gpu = f", {len(self.gpus)} GPU(s)" if self.gpus else ""
        node = f" on {len(self.nodes)} Ray node(s)" if self.nodes else ""
        return f"{self.cpus:g} CPU core(s){gpu}{node}"


@dataclass
class Placement:
    """Where one policy worker runs and what it is predicted to take per step."""

    index: int
    name: str
    params: int
    cpu_share: float
    """Cores this worker is planned to use (fractional when cores are time-shared)."""
    threads: int
    """torch intra-op threads of each of its workers (each rank's, for a policy on several)."""
    nice: int = 0
    """CPU priority offset (0 = normal); realises fractional shares on shared cores."""
    node: str | None = None
    gpu: int | None = None
    gpu_fraction: float = 0.0
    colocated: bool = True
    """Rollout and update in the same worker (always, today)."""
    predicted_rollout_s: float = 0.0
    predicted_update_s: float = 0.0
    ranks: int = 1
    """Data-parallel workers of the policy (each on its own GPU from ``gpu`` on, or sharing the cores)."""
    predicted_allreduce_s: float = 0.0
    """Of ``predicted_update_s``: the gradients' all-reduce over the ranks."""

    @property
    def predicted_step_s(self) -> float:
        return self.predicted_rollout_s + self.predicted_update_s

    @property
    def device(self) -> str:
        """The device the plan gives this worker: ``cuda:<gpu>`` or ``cpu``."""
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"


@dataclass
class Allocation:
    """A plan: one :class:`Placement` per policy, in policy order."""

    placements: list[Placement]
    resources: Resources
    mode: str
    """``exclusive`` (whole cores each), ``shared`` (fractional shares), ``gpu`` or ``equal``."""
    calibrated: bool = False
    act_bytes_per_token: list[float | None] | None = None
    """The update's activation bytes per token each policy's worker measured (memory price), if any."""

    @property
    def predicted_step_s(self) -> float:
        """Predicted synchronous step time: the slowest worker."""
        return max(p.predicted_step_s for p in self.placements)

    @property
    def predicted_imbalance(self) -> float:
        """Largest ÷ smallest predicted busy time per step."""
        t = [p.predicted_step_s for p in self.placements]
        return max(t) / max(min(t), 1e-12)

    def threads(self) -> list[int]:
        return [p.threads for p in self.placements]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "calibrated": self.calibrated, "resources": asdict(self.resources),
                "predicted_step_s": self.predicted_step_s, "predicted_imbalance": self.predicted_imbalance,
                "placements": [asdict(p) | {"predicted_step_s": p.predicted_step_s} for p in self.placements]}

    def describe(self) -> str:
        """A plain-text table of the plan."""
        head = ["policy", "params", "ranks", "device", "cores", "threads", "nice", "node", "gpu", "rollout_s",
                "update_s", "step_s"]
        rows = []
        for p in self.placements:
            gpu = "-" if p.gpu is None else (f"{p.gpu}-{p.gpu + p.ranks - 1}" if p.ranks > 1 else f"{p.gpu}") + (
                "" if p.gpu_fraction >= 1 else f" ({p.gpu_fraction:.2f})")
            node = "-" if p.node is None else p.node[:10]
            rows.append([p.name, _human(p.params), str(p.ranks), p.device, f"{p.cpu_share:.2f}", str(p.threads), str(p.nice), node, gpu,
                         f"{p.predicted_rollout_s:.3g}", f"{p.predicted_update_s:.3g}", f"{p.predicted_step_s:.3g}"])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        cal = "calibrated" if self.calibrated else "from parameters x tokens (uncalibrated)"
        out = [f"MWRA plan: {self.resources.describe()}, mode {self.mode}, step times {cal}",
               line(head), line(["-" * w for w in widths]), *map(line, rows),
               f"predicted step {self.predicted_step_s:.3g}s, imbalance (max/min busy) {self.predicted_imbalance:.2f}"]
        return "\n".join(out)


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _cpu_placements(cfg: RunConfig, costs: CostModel, idx: list[int], cores: float,
                    node: str | None = None) -> list[Placement]:
    core_s = [sum(costs.core_seconds(i)) for i in idx]
    shares = balanced_shares(core_s, cores, costs.parallel_fraction)
    threads, nice = shares_to_threads(shares, cores)
    real = realised_shares(threads, nice, cores)
    out = []
    ranks = fixed_ranks(cfg)
    for i, s, t, n in zip(idx, real, threads, nice, strict=True):
        w = ranks[i] or _cpu_auto_ranks(cfg, costs, i, s, t)
        r, u = costs.seconds(i, s / w)  # each rank: 1/w of the work on 1/w of the share
        r, u = r / w, u / w
        ar = costs.allreduce_s(i, w)
        out.append(Placement(i, cfg.policies[i].name, costs.effective_params(i), s, max(1, t // w), n, node,
                             predicted_rollout_s=r, predicted_update_s=u + ar, ranks=w, predicted_allreduce_s=ar))
    return out


def _cpu_auto_ranks(cfg: RunConfig, costs: CostModel, i: int, share: float, threads: int) -> int:
    """A ``workers: auto`` policy's ranks on CPU cores: the count, from 1 to its threads (a thread and
    a prompt a rank at least; 2 at least with ``fsdp``), whose predicted step is shortest. Each rank
    does 1/w of the work on 1/w of the policy's cores, so ranks shrink the part of the work threads do
    not speed up, and add the gradient all-reduce: the tiny zoo policies gain from 2 ranks on 2 cores,
    SmolLM2-135M and Gemma-3-270M do not (``benchmarks/data_parallel.py``). One worker under the
    ``sequential`` scheduler (no processes to rank)."""
    least = 2 if cfg.policies[i].fsdp else 1
    if cfg.scheduler == "sequential":
        return 1
    most = max(least, min(threads, cfg.prompts_per_step))

    def step(w: int) -> float:
        r, u = costs.seconds(i, share / w)
        return (r + u) / w + costs.allreduce_s(i, w)

    return min(range(least, most + 1), key=step)


def _mode(placements: list[Placement]) -> str:
    whole = all(abs(p.cpu_share - round(p.cpu_share)) < 1e-6 and p.nice == 0 for p in placements)
    return "exclusive" if whole else "shared"


# ----------------------------------------------------------------------------- GPUs
def model_memory_gb(params: int, beta: float = 0.0) -> float:
    """Training memory of fp32 weights + grads + Adam moments (+ a reference copy), GiB."""
    return params * (16 + (4 if beta > 0 else 0)) / 2**30


def _ranked_gpu_placements(cfg: RunConfig, costs: CostModel, idx: list[int], gpus: list[GPUDevice],
                           cores: float, node: str | None = None) -> list[Placement]:
    """Whole GPUs per policy, several for a policy with ``workers`` > 1 or ``auto``
    (:func:`~mutualrl.allocation.data_parallel.split_devices`), in consecutive blocks."""
    speed = PRIOR_GPU_S_PER_FLOP / PRIOR_CORE_S_PER_FLOP
    step = [sum(costs.core_seconds(i)) * speed for i in idx]
    fixed = [fixed_ranks(cfg)[i] for i in idx]
    trainable = [costs.trainable_params(i) for i in idx]
    comm = lambda j, n: allreduce_seconds(trainable[j], n, GPU_ALLREDUCE_GB_S)
    counts = split_devices(step, len(gpus), fixed, comm, most=cfg.prompts_per_step)
    if sum(counts) > len(gpus):
        raise ConfigError(f"policies[{idx[0]}].workers", f"the policies ask for {sum(counts)} GPUs (ranks "
                          f"{counts}) and {len(gpus)} are there: lower workers, or use auto")
    out, first = [], 0
    order = sorted(gpus, key=lambda g: g.index)
    for j, i in enumerate(idx):
        n = counts[j]
        pol = cfg.policies[i]
        full = model_memory_gb(costs.effective_params(i), cfg.policy_grpo(i).beta)
        if pol.fsdp and n > 1:  # the training state sharded over the ranks, beside the sampler's full copy
            full = costs.effective_params(i) * 4 / 2**30 + full / n
        need = full if pol.peft is None else costs.effective_params(i) * 4 / 2**30
        have = min(g.memory_gb for g in order[first:first + n])
        if have and need > have:
            raise ConfigError(f"policies[{i}]", f"{pol.name} needs about {need:.0f} GiB on each of its ranks "
                              f"({'its sampler copy and its share of the sharded training state' if pol.fsdp else 'every rank holds the whole model: fp32 weights'}"
                              f"{', gradients and AdamW moments' if pol.peft is None and not pol.fsdp else ''}); "
                              f"its GPUs have {have:.0f} GiB. Train a LoRA adapter (peft), shard the training state "
                              "over more ranks (fsdp: true, more workers), or use a smaller model")
        r, u = costs.core_seconds(i)
        ar = comm(j, n)
        out.append(Placement(i, cfg.policies[i].name, costs.effective_params(i), cores / len(idx),
                             max(1, int(cores // sum(counts))), 0, node, order[first].index, 1.0,
                             predicted_rollout_s=r * speed / n, predicted_update_s=u * speed / n + ar, ranks=n,
                             predicted_allreduce_s=ar))
        first += n
    return out


def _gpu_placements(cfg: RunConfig, costs: CostModel, idx: list[int], gpus: list[GPUDevice], cores: float,
                    node: str | None = None) -> list[Placement]:
    k = len(idx)
    if any(cfg.policies[i].workers != 1 for i in idx):  # whole GPUs per rank (refused when too few)
        return _ranked_gpu_placements(cfg, costs, idx, gpus, cores, node)
    order = sorted(idx, key=lambda i: -sum(costs.core_seconds(i)))
    devs = sorted(gpus, key=lambda g: -g.memory_gb)
    load = {g.index: 0.0 for g in devs}
    mem = {g.index: g.memory_gb for g in devs}
    assign: dict[int, int] = {}
    for j, i in enumerate(order):
        need = model_memory_gb(costs.effective_params(i), cfg.policy_grpo(i).beta)
        if len(devs) >= k:
            g = devs[j]
        else:
            fits = [g for g in devs if mem[g.index] >= need or g.memory_gb == 0] or devs
            g = min(fits, key=lambda d: load[d.index])
        assign[i] = g.index
        load[g.index] += sum(costs.core_seconds(i))
        mem[g.index] -= need
    threads = max(1, int(cores // k))
    out = []
    for i in sorted(idx):
        g = assign[i]
        frac = 1.0 if len(devs) >= k else sum(costs.core_seconds(i)) / max(load[g], 1e-12)
        r, u = costs.core_seconds(i)
        speed = PRIOR_GPU_S_PER_FLOP / PRIOR_CORE_S_PER_FLOP / frac
        out.append(Placement(i, cfg.policies[i].name, costs.effective_params(i), cores / k, threads, 0, node,
                             g, round(frac, 4), predicted_rollout_s=r * speed, predicted_update_s=u * speed))
    return out


# ----------------------------------------------------------------------------- the planner
def plan(cfg: RunConfig, resources: Resources, costs: CostModel | None = None) -> Allocation:
    """The balanced allocation of ``cfg``'s policies on ``resources``.

    ``costs`` defaults to an uncalibrated :class:`CostModel` from the policies' parameter counts.
    """
    if costs is None:
        costs = CostModel(cfg, estimate_parameters(cfg))
    k = len(cfg.policies)
    if resources.nodes:
        placements = _plan_nodes(cfg, resources, costs)
        mode = "gpu" if any(p.gpu is not None for p in placements) else _mode(placements)
    elif resources.gpus:
        placements = _gpu_placements(cfg, costs, list(range(k)), resources.gpus, resources.cpus)
        mode = "gpu"
    else:
        placements = _cpu_placements(cfg, costs, list(range(k)), resources.cpus)
        mode = _mode(placements)
    return Allocation(placements, resources, mode, costs.calibrated, list(costs.act_bytes_per_token))


def plan_equal(cfg: RunConfig, resources: Resources, costs: CostModel | None = None) -> Allocation:
    """The naive allocation: every worker the same share and threads, whatever it costs."""
    if costs is None:
        costs = CostModel(cfg, estimate_parameters(cfg))
    k = len(cfg.policies)
    share = resources.cpus / k
    threads = max(1, int(share))
    out = []
    for i in range(k):
        r, u = costs.seconds(i, share)
        out.append(Placement(i, cfg.policies[i].name, costs.effective_params(i), share, threads,
                             predicted_rollout_s=r, predicted_update_s=u))
    return Allocation(out, resources, "equal", costs.calibrated, list(costs.act_bytes_per_token))


def evaluate_allocation(alloc: Allocation, costs: CostModel) -> Allocation:
    """The same placements with step times predicted by (newly calibrated) ``costs``."""
    out = []
    for p in alloc.placements:
        w = max(1, p.ranks)
        if p.gpu is None:  # as _cpu_placements prices it: each rank 1/w of the work on 1/w of the share
            ar = costs.allreduce_s(p.index, w)
            r, u = costs.seconds(p.index, p.cpu_share / w)
            r, u = r / w, u / w + ar
        else:
            ar = p.predicted_allreduce_s
            r, u = costs.seconds(p.index, p.cpu_share)
        out.append(Placement(**{**asdict(p), "predicted_rollout_s": r, "predicted_update_s": u,
                                "predicted_allreduce_s": ar}))
    return Allocation(out, alloc.resources, alloc.mode, costs.calibrated, list(costs.act_bytes_per_token))


def should_replan(current: Allocation, costs: CostModel, resources: Resources,
                  threshold: float = 1.25) -> Allocation | None:
    """A new plan when the calibrated imbalance of ``current`` exceeds ``threshold`` and the new
    plan predicts a clearly shorter step (5 %); otherwise ``None``."""
    now = evaluate_allocation(current, costs)
    if now.predicted_imbalance <= threshold:
        return None
    new = plan(costs.cfg, resources, costs)
    if new.predicted_step_s < 0.95 * now.predicted_step_s:
        return new
    return None


def _plan_nodes(cfg: RunConfig, resources: Resources, costs: CostModel) -> list[Placement]:
    """Spread workers over Ray nodes (largest cost first, to the least loaded node per CPU)."""
    k = len(cfg.policies)
    order = sorted(range(k), key=lambda i: -sum(costs.core_seconds(i)))
    nodes = [n for n in resources.nodes if n.cpus > 0 or n.gpus]
    if not nodes:
        raise ValueError("the Ray cluster has no node with CPUs or GPUs")
    load = {n.node_id: 0.0 for n in nodes}
    count = {n.node_id: 0 for n in nodes}
    members: dict[str, list[int]] = {n.node_id: [] for n in nodes}
    for i in order:
        c = sum(costs.core_seconds(i))
        # prefer a node with a whole CPU per worker left, then the lightest load per CPU
        best = min(nodes, key=lambda n: (count[n.node_id] + 1 > max(n.cpus, len(n.gpus)),
                                         (load[n.node_id] + c) / max(n.cpus, 1e-6)))
        load[best.node_id] += c
        count[best.node_id] += 1
        members[best.node_id].append(i)
    out: list[Placement] = []
    for n in nodes:
        idx = sorted(members[n.node_id])
        if not idx:
            continue
        if n.gpus:
            sub = _gpu_placements(cfg, costs, idx, n.gpus, n.cpus, n.node_id)
        else:
            sub = _cpu_placements(cfg, costs, idx, max(n.cpus, 1e-3), n.node_id)
        out.extend(sub)
    return sorted(out, key=lambda p: p.index)


def plan_for(cfg: RunConfig, resources: Resources) -> Allocation:
    """:func:`plan`, without pricing the policies when there is nothing to choose between (CPU cores
    alone, one node): then every worker gets an equal share (what workers sharing one process get)."""
    if resources.gpus or resources.nodes:
        return plan(cfg, resources)
    k = max(1, len(cfg.policies))
    share = resources.cpus / k
    return Allocation([Placement(i, p.name, 0, share, max(1, int(share)), ranks=p.workers if isinstance(p.workers, int)
                                 else 1) for i, p in enumerate(cfg.policies)], resources, "equal")
