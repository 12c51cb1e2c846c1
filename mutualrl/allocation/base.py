"""The scheduler protocol: where policy workers live and how the controller calls them.

A scheduler owns K :class:`~mutualrl.worker.PolicyWorker` instances (in this process, in
subprocesses, or as Ray actors) and calls the same method on all of them for each phase of a
step. Only JSON-able values cross the boundary (step numbers in, metric dicts out).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mutualrl.worker_api import WorkerMethod, remote_name

if TYPE_CHECKING:
    from mutualrl.resolve import RunPlan


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
    """Runs the policy workers of one run."""

    name: str = "base"

    @abstractmethod
    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        """Create the workers for ``plan`` (placing each one); return each worker's ``info()``."""

    def call(self, method: WorkerMethod | str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` (a :class:`~mutualrl.worker_api.WorkerAPI` method) on every worker,
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

    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        import torch

        from mutualrl.allocation.placement import exchange_url, place
        from mutualrl.allocation.planner import Resources, plan_for
        from mutualrl.worker import PolicyWorker

        cfg = plan.config
        threads = self.threads or cfg.threads
        if threads:
            torch.set_num_threads(threads)
        if not plan.placed:
            plan = place(plan, plan_for(cfg, Resources.detect()), "sequential",
                         exchange_url("sequential", cfg, run_dir), threads=threads)
        self.workers = [PolicyWorker(plan, i, run_dir) for i in range(len(cfg.policies))]
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
