"""RayScheduler: each policy worker a Ray actor in its own placement group.

Ray is joined with ``ray.init(address="auto")`` when ``RAY_ADDRESS`` is set, reused when this
process is already connected, and otherwise started locally (``include_dashboard=False``). The
MWRA plan is made from the cluster's resources: workers are spread over nodes, each gets a
placement group with one bundle (``CPU`` = its core share, ``GPU`` when planned) pinned to its
node, and its torch threads. The exchange is the run's sqlite file when the cluster has one node,
and a ``ray://<run name>`` actor (backed by the run's sqlite file on the driver's node when there
is a run directory) when it has several. Only JSON text crosses the actor boundary. Every call
has the ``step_timeout_s`` deadline; a dead actor or a late answer raises
:class:`~mutualrl.allocation.base.WorkerFailed` naming the worker.

A policy with ``workers: N`` is N actors, its ranks, in one placement group of N bundles (``PACK``:
on one node when it fits, spread otherwise); they meet through a ``TCPStore`` served by the driver
on its node's address (:mod:`mutualrl.run.distributed`), and a call on the policy goes to every rank
(:mod:`mutualrl.allocation.ranks`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from mutualrl.allocation.base import Scheduler, Venue, WorkerFailed, require_placed
from mutualrl.allocation.gpu_memory import allocator_env
from mutualrl.allocation.planner import Allocation, Resources
from mutualrl.allocation.ranks import PendingReplies, RankLayout, merge_replies
from mutualrl.config import RunConfig
from mutualrl.config.resolve import RunPlan, WorkerSpec
from mutualrl.errors import UserError
from mutualrl.exchange import open_exchange
from mutualrl.run.distributed import lagging_rank, serve_store
from mutualrl.run.worker import PolicyWorker
from mutualrl.run.worker_api import WorkerAPI, remote_name


class RayPolicyWorker:
    """The actor body: a :class:`~mutualrl.run.worker.PolicyWorker` behind a JSON-text interface."""

    def __init__(self, plan_json: str, index: int, run_dir: str | None, rank: int = 0) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        plan = RunPlan.from_dict(json.loads(plan_json))
        os.environ["MUTUALRL_WORKER"] = plan.spec(index, rank).label  # as a local worker process is named
        # resolved and placed by the controller (a planned GPU is the bundle's, seen as cuda:0)
        self.worker = PolicyWorker(plan, index, run_dir, rank=rank)

    def call(self, method: str, args_json: str) -> str:
        """Run ``method(*args)``; the reply is JSON text with the result, wall and CPU time."""
        method = remote_name(method)
        t0, c0 = time.perf_counter(), time.process_time()
        result = getattr(self.worker, method)(*json.loads(args_json))
        return json.dumps({"result": result, "wall_s": time.perf_counter() - t0,
                           "cpu_s": time.process_time() - c0})

    def where(self) -> str:
        """JSON: this actor's node id and process id."""
        import ray

        return json.dumps({"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()})


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise UserError("scheduler: ray needs Ray: pip install 'mutualrl[ray]'") from exc
    return ray


def connect_ray() -> bool:
    """Connect to Ray if needed; True when this call started it (and so should shut it down)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)
    return True


def bundle_for(spec: WorkerSpec) -> dict[str, float]:
    """The placement-group bundle that realises one placed worker (one rank): its core share and,
    on a GPU, its share of one (Ray wants whole numbers above one unit; shares rounded down so the
    bundles fit the cores)."""
    share = spec.cpu_share if spec.cpu_share is not None else 1.0
    cpu = share if share < 1 else float(int(share + 1e-9))
    bundle = {"CPU": max(math.floor(cpu * 1e4) / 1e4, 0.01)}
    if spec.device is not None and spec.device.startswith("cuda"):
        bundle["GPU"] = spec.gpu_fraction if spec.gpu_fraction and spec.gpu_fraction < 1 else 1.0
    return bundle


def actor_env(spec: WorkerSpec, environ: dict[str, str] | None = None,
              job_env: dict[str, str] | None = None, engine: str = "hf") -> dict[str, str]:
    """Environment variables a placed worker's actor is started with (its ``runtime_env``): on a
    GPU, the caching allocator's ``expandable_segments``
    (:func:`~mutualrl.allocation.gpu_memory.allocator_env`) unless the user set the allocator's
    variable, in the driver's environment (``environ``) or the job's runtime environment (``job_env``),
    or the policy samples with vLLM (``engine``)."""
    if spec.device is None or not spec.device.startswith("cuda"):
        return {}
    return allocator_env({**(job_env or {}), **(os.environ if environ is None else environ)}, engine)


def _job_env_vars(ray: Any) -> dict[str, str]:
    """The ``env_vars`` of the job's runtime environment (``ray.init(runtime_env=...)``), if any."""
    try:
        return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})
    except Exception:  # noqa: BLE001 - an older Ray without it: the driver's environment decides
        return {}


class RayScheduler(Scheduler):
    """Policy workers as Ray actors (one placement group each), called concurrently with a timeout.

    Args:
        threads: torch threads per worker (default: the MWRA plan decides).
        allocation: use this plan as is.
        exchange: override the exchange URL the workers use.
        verbose: print the plan to stderr.
    """

    name = "ray"

    def __init__(self, threads: int | None = None, *, allocation: Allocation | None = None,
                 exchange: str | None = None, verbose: bool = True) -> None:
        self.threads = threads
        self.fixed_allocation = allocation
        self.exchange = exchange
        self.verbose = verbose
        self.actors: list[Any] = []
        self.groups: list[Any] = []
        self.names: list[str] = []
        self.node_ids: list[str] = []
        self.resources: Resources | None = None
        self.timeout = 600.0
        self.run_dir: Path | None = None
        self.exchange_url = ""
        self._started_ray = False
        self._driver_exchange: Any = None
        self._scratch: str | None = None
        self._inflight: dict[int, tuple[Any, str, float]] = {}
        self.last_cpu_s: dict[int, float | None] = {}
        self.last_wall_s: dict[int, float | None] = {}
        self.layout = RankLayout([])
        self._pending: PendingReplies | None = None
        self._store: Any = None
        self._policy_names: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def open(self, cfg: RunConfig, run_dir: Path | None) -> Venue:
        """Connect to Ray (or start a local cluster); the run's exchange (a ``ray://`` store of its
        own on a cluster of several nodes) and the ranks' rendezvous at the driver; the cluster's
        resources. Ray bundles are fixed once placed: MWRA calibrates and reports, nothing moves."""
        ray = _import_ray()
        self._started_ray = connect_ray()
        self.timeout = float(cfg.step_timeout_s)
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self.resources = Resources.from_ray()
        if self.run_dir is None:
            self._scratch = tempfile.mkdtemp(prefix="mutualrl-ray-")
        rendezvous = None
        if any(p.workers != 1 for p in cfg.policies):  # the ranks of a policy meet at the driver
            host = ray.util.get_node_ip_address()
            self._store = serve_store(host, self.timeout)
            rendezvous = f"tcp://{host}:{self._store.port}"
        return Venue("ray", self.resources, Path(self._scratch) if self._scratch else None, rendezvous,
                     movable=False)

    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        require_placed(plan, self.name)
        if self.resources is None:
            raise ValueError("RayScheduler.start before open(): start it with run_placement.launch")
        cfg, resources = plan.config, self.resources
        self.exchange_url = plan.workers[0].exchange or ""
        if self.exchange_url.startswith("ray://") and cfg.exchange in ("sqlite", "memory://"):
            self._driver_exchange = open_exchange(self.exchange_url)  # the run's own store, on the driver's node
        self.layout = RankLayout.of(plan)
        self._policy_names = [p.name for p in cfg.policies]
        self._pending = PendingReplies(self.layout)
        self.names = list(self.layout.labels)
        actor_cls = ray.remote(RayPolicyWorker)
        try:
            for ranks in self.layout.members:  # one placement group per policy, a bundle per rank, as placed
                specs = [plan.workers[w] for w in ranks]
                kwargs: dict[str, Any] = {}
                if specs[0].node is not None and len(resources.nodes) > 1 and len(specs) == 1:
                    kwargs["bundle_label_selector"] = [{"ray.io/node-id": specs[0].node}]
                pg = placement_group([bundle_for(sp) for sp in specs],
                                     strategy="STRICT_PACK" if len(specs) == 1 else "PACK", **kwargs)
                self.groups.append(pg)
            for i, pg in enumerate(self.groups):
                ready, _ = ray.wait([pg.ready()], timeout=self.timeout)
                if not ready:
                    want = [bundle_for(plan.workers[w]) for w in self.layout.members[i]]
                    raise WorkerFailed(cfg.policies[i].name, f"placement group {want} not placed within "
                                       f"{self.timeout:g}s; cluster: {resources.describe()}")
            job_env = _job_env_vars(ray)
            for spec in plan.workers:
                b = bundle_for(spec)
                env = actor_env(spec, job_env=job_env, engine=plan.config.policies[spec.index].generation.engine)
                actor = actor_cls.options(
                    num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0, max_concurrency=1,
                    **({"runtime_env": {"env_vars": env}} if env else {}),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.groups[spec.index],
                                                                         placement_group_bundle_index=spec.rank),
                ).remote(json.dumps(plan.to_dict()), spec.index, str(self.run_dir) if self.run_dir else None, spec.rank)
                self.actors.append(actor)
            wheres = self._gather([a.where.remote() for a in self.actors], "start", raw=True)
            self.node_ids = [json.loads(w)["node_id"] for w in wheres]
            infos = self.call(WorkerAPI.info)
        except BaseException:
            self.close()
            raise
        for info, ws in zip(infos, self.layout.members, strict=True):
            info.update(json.loads(wheres[ws[0]]))
        return infos

    def close(self) -> None:
        """Kill the actors, remove their placement groups, stop Ray if this scheduler started it."""
        try:
            ray = _import_ray()
        except UserError:
            return
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass
        self.actors, self.groups, self._inflight = [], [], {}
        self._store = None
        if self._driver_exchange is not None:
            try:
                self._driver_exchange.close()
                destroy = getattr(self._driver_exchange, "destroy", None)
                if destroy is not None:
                    destroy()
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass
            self._driver_exchange = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, *args: Any) -> list[Any]:
        refs = [a.call.remote(method, json.dumps(list(args))) for a in self.actors]
        return self.layout.merge(method, self._gather(refs, method))

    def _call_one(self, index: int, method: str, *args: Any) -> Any:
        ranks = self.layout.members[index]
        refs = [self.actors[w].call.remote(method, json.dumps(list(args))) for w in ranks]
        return merge_replies(method, self._gather(refs, method, indices=ranks))

    def _submit(self, index: int, method: str, *args: Any) -> None:
        for w in self.layout.members[index]:
            if w in self._inflight:
                raise WorkerFailed(self.names[w], f"{method}() sent while {self._inflight[w][1]}() is running")
        for w in self.layout.members[index]:
            ref = self.actors[w].call.remote(method, json.dumps(list(args)))
            self._inflight[w] = (ref, method, time.monotonic() + self.timeout)

    def collect(self, timeout: float) -> tuple[int, Any]:
        ray = _import_ray()
        assert self._pending is not None
        while True:
            if not self._inflight:
                raise WorkerFailed("?", "collect() called with no call in flight")
            by_ref = {v[0]: k for k, v in self._inflight.items()}
            deadline = min(time.monotonic() + timeout, min(v[2] for v in self._inflight.values()))
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                w = self._behind(min(self._inflight, key=lambda k: self._inflight[k][2]))
                raise WorkerFailed(self.names[w], f"no reply to {self._inflight[w][1]}() within {self.timeout:g}s "
                                   f"(step_timeout_s) {self._where(w)}")
            w = by_ref[ready[0]]
            _, method, _ = self._inflight.pop(w)
            index = self._pending.add(w, self._get(w, ready[0], method))
            if index is None:
                continue  # another rank of the policy is still at it
            return index, self._pending.pop(index, method)

    def _get(self, i: int, ref: Any, method: str, raw: bool = False) -> Any:
        ray = _import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        try:
            text = ray.get(ref)
        except RayActorError as exc:
            raise WorkerFailed(self.names[i], f"actor died during {method}() {self._where(i)}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") \
                from None
        except RayTaskError as exc:
            dead = self._dead_rank(i)
            if dead is not None:  # another rank's actor died and this one failed in a collective with it
                raise WorkerFailed(self.names[dead], f"actor died during {method}() {self._where(dead)}\n(then "
                                   f"{self.names[i]}: {exc})") from None
            culprit = self._behind(i)
            if culprit != i:  # it failed waiting for another rank of its policy
                raise WorkerFailed(self.names[culprit], f"fell behind its policy's other ranks in {method}() "
                                   f"{self._where(culprit)}\n(then {self.names[i]}: {exc})") from None
            raise WorkerFailed(self.names[i], f"{method}() raised {exc}") from None
        if raw:
            return text
        msg = json.loads(text)
        self.last_cpu_s[i] = msg.get("cpu_s")
        self.last_wall_s[i] = msg.get("wall_s")
        return msg["result"]

    def _dead_rank(self, worker: int, wait_s: float = 5.0) -> int | None:
        """Another rank of ``worker``'s policy whose actor died (given ``wait_s`` to show it), as the
        local scheduler looks for a dead process before asking who is behind; None when there is none."""
        ray = _import_ray()
        from ray.exceptions import RayActorError

        others = [w for w in self.layout.members[self.layout.policy_of(worker)] if w != worker and w in self._inflight]
        if not others:
            return None
        refs = {self._inflight[w][0]: w for w in others}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                return refs[ref]
            except Exception:  # noqa: BLE001, S112 - that rank failed otherwise: not a death
                continue
        return None

    def _behind(self, worker: int) -> int:
        """Of ``worker``'s policy's ranks, the one behind the others in the collectives they reach
        (:func:`~mutualrl.run.distributed.progress`): the rank the others wait for; ``worker`` itself when
        none is behind or the policy has one rank."""
        i = self.layout.policy_of(worker)
        ranks = self.layout.members[i]
        if len(ranks) == 1 or self._store is None:
            return worker
        behind = lagging_rank(self._store, self._policy_names[i], len(ranks))
        return worker if behind is None else ranks[behind]

    def _where(self, i: int) -> str:
        """``on node <id> (dead|alive)`` for worker ``i``'s node, when it is known."""
        if i >= len(self.node_ids):
            return ""
        node = self.node_ids[i]
        try:
            alive = next((n["Alive"] for n in _import_ray().nodes() if n["NodeID"] == node), None)
        except Exception:  # noqa: BLE001 - the cluster may be going down: the id is enough
            alive = None
        state = "" if alive is None else (" (alive)" if alive else " (dead: the node was lost)")
        return f"on node {node}{state}"

    def _gather(self, refs: list[Any], method: str, *, raw: bool = False,
                indices: list[int] | None = None) -> list[Any]:
        ray = _import_ray()
        idx = indices if indices is not None else list(range(len(refs)))
        where = dict(zip(refs, idx, strict=True))
        out: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = self._behind(where[pending[0]])
                raise WorkerFailed(self.names[late], f"no reply to {method}() within {self.timeout:g}s "
                                   f"(step_timeout_s) {self._where(late)}")
            for r in ready:
                out[where[r]] = self._get(where[r], r, method, raw)
        return [out[i] for i in idx]

    def cpu_seconds(self, index: int) -> float | None:
        return self.layout.total(index, self.last_cpu_s)
