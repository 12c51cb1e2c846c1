"""The scheduler protocol: where policy workers live and how the controller calls them.

A scheduler owns K :class:`~mutualrl.run.worker.PolicyWorker` instances (in this process, in
subprocesses, or as Ray actors) and calls the same method on all of them for each phase of a
step. Only JSON-able values cross the boundary (step numbers in, metric dicts out).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mutualrl.run.worker_api import WorkerMethod, remote_name

if TYPE_CHECKING:
    from mutualrl.allocation.planner import Allocation, Resources
    from mutualrl.config import RunConfig
    from mutualrl.config.resolve import RunPlan


@dataclass(frozen=True)
class Venue:
    """What an opened scheduler offers the placement step (:mod:`mutualrl.allocation.run_placement`).

    Attributes:
        backend: how a worker sees its device (``sequential``, ``local`` or ``ray``; see
            :func:`~mutualrl.allocation.placement.place`).
        resources: what may be handed out (this machine, or the Ray cluster).
        scratch: a directory the scheduler keeps for the run (the exchange file of a run without a
            directory, when workers in several processes must share one).
        rendezvous: ``tcp://HOST:PORT`` where the ranks of a multi-worker policy meet (None: no such policy).
        movable: whether the scheduler can realise a re-plan of threads and CPU priority while it runs.
    """

    backend: str
    resources: Resources
    scratch: Path | None = None
    rendezvous: str | None = None
    movable: bool = False


class WorkerFailed(RuntimeError):
    """A policy worker died, hung past the timeout or raised.

    ``worker`` names it, ``detail`` says what happened; the trainer re-raises it with
    ``checkpoint`` set to the run's last good checkpoint (None when there is none yet)."""

    def __init__(self, worker: str, detail: str, *, checkpoint: str | None = None, resume: str | None = None) -> None:
        self.worker = worker
        self.detail = detail
        self.checkpoint = checkpoint
        tail = ""
        if resume is not None:
            where = f"last good checkpoint: {checkpoint}" if checkpoint else "no checkpoint was written yet"
            tail = f"; {where}. Resume with: mutualrl train --resume {resume}"
        super().__init__(f"policy worker {worker!r} failed: {detail}{tail}")


class Scheduler(ABC):
    """Runs the policy workers of one run: it realises a placed plan and decides nothing.

    The life of a run's scheduler: :meth:`open` sets up what the workers need beside them (a Ray
    connection, a scratch directory, the ranks' rendezvous) and says what can be placed on;
    the placement step (:func:`~mutualrl.allocation.run_placement.launch`) plans and places;
    :meth:`start` creates the workers of the placed plan; :meth:`realise` applies a re-planned one;
    :meth:`close` stops everything.

    ``threads`` (torch threads for every worker), ``fixed_allocation`` (an allocation to use as
    is), ``exchange`` (an exchange URL for every worker instead of the run's), ``replan_threshold``,
    ``verbose`` (print plans) and ``calibrate_steps`` (time that many real steps of each policy before
    the first plan; 0: plan from the FLOP prior) are the caller's requests, read by the placement step.
    """

    name: str = "base"
    threads: int | None = None
    fixed_allocation: Allocation | None = None
    exchange: str | None = None
    replan_threshold: float = 1.25
    verbose: bool = True
    calibrate_steps: int = 0

    @abstractmethod
    def open(self, cfg: RunConfig, run_dir: Path | None) -> Venue:
        """Prepare what the run's workers will need beside them; what the plan may be placed on."""

    @abstractmethod
    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        """Create the workers of the placed ``plan``; return each worker's ``info()``."""

    def realise(self, plan: RunPlan) -> None:
        """Apply a re-placed ``plan`` (same workers, other threads or CPU priority) to the running
        workers. Only called when :meth:`open` said ``movable``."""
        raise NotImplementedError(f"the {self.name} scheduler cannot move running workers")

    def cpu_seconds(self, index: int) -> float | None:
        """CPU time (all threads, all ranks) of policy ``index``'s last call, where measured."""
        return None

    def call(self, method: WorkerMethod | str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` (a :class:`~mutualrl.run.worker_api.WorkerAPI` method) on every worker,
        concurrently where possible; the results in policy order."""
        return self._call(remote_name(method), *args)

    def call_one(self, index: int, method: WorkerMethod | str, *args: Any) -> Any:
        """Call ``method(*args)`` on worker ``index``; a failure raises :class:`WorkerFailed`."""
        return self._call_one(index, remote_name(method), *args)

    def submit(self, index: int, method: WorkerMethod | str, *args: Any) -> None:
        """Start ``method(*args)`` on worker ``index`` without waiting (the trainer's ``sync: async``
        mode: one call in flight per worker); :meth:`collect` returns its result."""
        self._submit(index, remote_name(method), *args)

    @abstractmethod
    def _call(self, method: str, *args: Any) -> list[Any]:
        """:meth:`call` with a checked method name."""

    @abstractmethod
    def _call_one(self, index: int, method: str, *args: Any) -> Any:
        """:meth:`call_one` with a checked method name."""

    def _submit(self, index: int, method: str, *args: Any) -> None:
        """:meth:`submit` with a checked method name (default: run it now, keep the result)."""
        if not hasattr(self, "_done"):
            self._done: deque[tuple[int, Any]] = deque()
        self._done.append((index, self._call_one(index, method, *args)))

    def collect(self, timeout: float) -> tuple[int, Any]:
        """Wait for the next finished submitted call: ``(worker index, result)``.

        Raises :class:`WorkerFailed` if that worker failed or nothing finished within ``timeout``.
        """
        done = getattr(self, "_done", None)
        if not done:
            raise WorkerFailed("?", "collect() called with no call in flight")
        return done.popleft()

    @abstractmethod
    def close(self) -> None:
        """Stop the workers (idempotent)."""


class SequentialScheduler(Scheduler):
    """All workers in this process, called one after another (the default: ``scheduler: sequential``)."""

    name = "sequential"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        self.workers: list[Any] = []

    def open(self, cfg: RunConfig, run_dir: Path | None) -> Venue:
        from mutualrl.allocation.planner import Resources

        return Venue("sequential", Resources.detect())

    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        import torch

        from mutualrl.run.worker import PolicyWorker

        require_placed(plan, self.name)
        threads = plan.workers[0].threads if plan.workers else None
        if threads:  # one process: the placed threads of every worker (the same number)
            torch.set_num_threads(threads)
        self.workers = [PolicyWorker(plan, i, run_dir) for i in range(len(plan.config.policies))]
        return [w.info() for w in self.workers]

    def _call(self, method: str, *args: Any) -> list[Any]:
        return [self._call_one(i, method, *args) for i in range(len(self.workers))]

    def _call_one(self, index: int, method: str, *args: Any) -> Any:
        w = self.workers[index]
        try:
            return getattr(w, method)(*args)
        except Exception as exc:  # name the worker; the trainer turns this into a clear stop
            raise WorkerFailed(w.name, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


def require_placed(plan: RunPlan, scheduler: str) -> None:
    """Refuse a plan no placement step has placed (a scheduler decides nothing)."""
    if not plan.placed:
        raise ValueError(f"the {scheduler} scheduler starts placed plans only: place it with "
                         "mutualrl.allocation.run_placement.launch(scheduler, plan, run_dir)")
