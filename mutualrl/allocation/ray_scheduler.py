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
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from mutualrl.allocation.adaptive import AdaptivePlan
from mutualrl.allocation.base import Scheduler, WorkerFailed
from mutualrl.allocation.placement import exchange_url, place
from mutualrl.allocation.planner import Allocation, Placement, Resources
from mutualrl.config import RunConfig
from mutualrl.errors import UserError
from mutualrl.exchange import open_exchange
from mutualrl.resolve import RunPlan
from mutualrl.worker import PolicyWorker
from mutualrl.worker_api import WorkerAPI, remote_name


class RayPolicyWorker:
    """The actor body: a :class:`~mutualrl.worker.PolicyWorker` behind a JSON-text interface."""

    def __init__(self, plan_json: str, index: int, run_dir: str | None) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # resolved and placed by the controller (a planned GPU is the bundle's, seen as cuda:0)
        self.worker = PolicyWorker(RunPlan.from_dict(json.loads(plan_json)), index, run_dir)

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


def bundle_for(p: Placement) -> dict[str, float]:
    """The placement-group bundle of one worker (Ray wants whole numbers above one unit)."""
    cpu = p.cpu_share if p.cpu_share < 1 else float(int(p.cpu_share + 1e-9))
    bundle = {"CPU": round(max(cpu, 0.01), 4)}
    if p.gpu is not None:
        bundle["GPU"] = p.gpu_fraction if p.gpu_fraction < 1 else float(int(p.gpu_fraction))
    return bundle


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
        self.exchange_override = exchange
        self.verbose = verbose
        self.actors: list[Any] = []
        self.groups: list[Any] = []
        self.names: list[str] = []
        self.node_ids: list[str] = []
        self.plan: AdaptivePlan | None = None
        self.timeout = 600.0
        self.run_dir: Path | None = None
        self.exchange_url = ""
        self._started_ray = False
        self._driver_exchange: Any = None
        self._scratch: str | None = None
        self._inflight: dict[int, tuple[Any, str, float]] = {}
        self.last_cpu_s: dict[int, float | None] = {}
        self.last_wall_s: dict[int, float | None] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_ray = connect_ray()
        cfg = plan.config
        self.timeout = float(cfg.step_timeout_s)
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        resources = Resources.from_ray()
        self.plan = AdaptivePlan(cfg, resources, threads=self.threads or cfg.threads,
                                 allocation=self.fixed_allocation, verbose=self.verbose)
        self.plan.fixed = True  # Ray bundles are fixed once placed: calibrate, report, do not move
        self.plan.say(self.plan.allocation.describe())
        self.exchange_url = self._exchange(cfg, resources)
        if not plan.placed:  # the one placement step, on the allocation the planner made
            plan = place(plan, self.plan.allocation, "ray", self.exchange_url)
        self.names = [p.name for p in cfg.policies]
        actor_cls = ray.remote(RayPolicyWorker)
        try:
            for pl in self.plan.allocation.placements:
                kwargs: dict[str, Any] = {}
                if pl.node is not None and len(resources.nodes) > 1:
                    kwargs["bundle_label_selector"] = [{"ray.io/node-id": pl.node}]
                pg = placement_group([bundle_for(pl)], strategy="STRICT_PACK", **kwargs)
                self.groups.append(pg)
            for i, pg in enumerate(self.groups):
                ready, _ = ray.wait([pg.ready()], timeout=self.timeout)
                if not ready:
                    raise WorkerFailed(self.names[i], f"placement group {bundle_for(self.plan.allocation.placements[i])} "
                                       f"not placed within {self.timeout:g}s; cluster: {resources.describe()}")
            for i, pl in enumerate(self.plan.allocation.placements):
                b = bundle_for(pl)
                actor = actor_cls.options(
                    num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0, max_concurrency=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.groups[i], placement_group_bundle_index=0),
                ).remote(json.dumps(plan.to_dict()), i, str(self.run_dir) if self.run_dir else None)
                self.actors.append(actor)
            wheres = self._gather([a.where.remote() for a in self.actors], "start", raw=True)
            self.node_ids = [json.loads(w)["node_id"] for w in wheres]
            infos = self.call(WorkerAPI.info)
        except BaseException:
            self.close()
            raise
        for info, w in zip(infos, wheres, strict=True):
            info.update(json.loads(w))
        self.plan.set_params([int(info.get("params") or 0) or None for info in infos])  # type: ignore[misc]
        self.plan.write(self.run_dir)
        return infos

    def _exchange(self, cfg: RunConfig, resources: Resources) -> str:
        """The exchange URL for the workers (:func:`~mutualrl.allocation.placement.exchange_url`); a
        ``ray://`` store of the run's own is created here, so that its actor lives on the driver's node."""
        if self.exchange_override:
            return self.exchange_override
        if self.run_dir is None:
            self._scratch = tempfile.mkdtemp(prefix="mutualrl-ray-")
        url = exchange_url("ray", cfg, self.run_dir, self._scratch, nodes=len(resources.nodes))
        if url.startswith("ray://") and cfg.exchange in ("sqlite", "memory://"):
            self._driver_exchange = open_exchange(url)
        return url

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
        if self._driver_exchange is not None:
            try:
                self._driver_exchange.close()
                destroy = getattr(self._driver_exchange, "destroy", None)
                if destroy is not None:
                    destroy()
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass
            self._driver_exchange = None
        if self.plan is not None:
            self.plan.write(self.run_dir)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, *args: Any) -> list[Any]:
        refs = [a.call.remote(method, json.dumps(list(args))) for a in self.actors]
        results = self._gather(refs, method)
        if method in ("rollout", "update") and self.plan is not None:
            for i, r in enumerate(results):
                self.plan.observe(i, method, r, self.last_cpu_s.get(i))
        return results

    def _call_one(self, index: int, method: str, *args: Any) -> Any:
        ref = self.actors[index].call.remote(method, json.dumps(list(args)))
        return self._gather([ref], method, indices=[index])[0]

    def _submit(self, index: int, method: str, *args: Any) -> None:
        if index in self._inflight:
            raise WorkerFailed(self.names[index], f"{method}() sent while {self._inflight[index][1]}() is running")
        ref = self.actors[index].call.remote(method, json.dumps(list(args)))
        self._inflight[index] = (ref, method, time.monotonic() + self.timeout)

    def collect(self, timeout: float) -> tuple[int, Any]:
        ray = _import_ray()
        if not self._inflight:
            raise WorkerFailed("?", "collect() called with no call in flight")
        by_ref = {v[0]: k for k, v in self._inflight.items()}
        deadline = min(time.monotonic() + timeout, min(v[2] for v in self._inflight.values()))
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            i = min(self._inflight, key=lambda k: self._inflight[k][2])
            raise WorkerFailed(self.names[i], f"no reply to {self._inflight[i][1]}() within {self.timeout:g}s "
                               f"(step_timeout_s) {self._where(i)}")
        i = by_ref[ready[0]]
        _, method, _ = self._inflight.pop(i)
        result = self._get(i, ready[0], method)
        if self.plan is not None:
            self.plan.observe(i, method, result, self.last_cpu_s.get(i))
        return i, result

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
            raise WorkerFailed(self.names[i], f"{method}() raised {exc}") from None
        if raw:
            return text
        msg = json.loads(text)
        self.last_cpu_s[i] = msg.get("cpu_s")
        self.last_wall_s[i] = msg.get("wall_s")
        return msg["result"]

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
                late = where[pending[0]]
                raise WorkerFailed(self.names[late], f"no reply to {method}() within {self.timeout:g}s "
                                   f"(step_timeout_s) {self._where(late)}")
            for r in ready:
                out[where[r]] = self._get(where[r], r, method, raw)
        return [out[i] for i in idx]

    @property
    def allocation(self) -> Allocation | None:
        """The allocation in force."""
        return self.plan.allocation if self.plan is not None else None
