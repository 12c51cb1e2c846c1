"""The scheduler protocol: where policy workers live and how the controller calls them.

A scheduler owns K :class:`~mutualrl.worker.PolicyWorker` instances (in this process, in
subprocesses, or as Ray actors) and calls the same method on all of them for each phase of a
step. Only JSON-able values cross the boundary (step numbers in, metric dicts out).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Any

from mutualrl.config import RunConfig


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
    def start(self, cfg: RunConfig, run_dir: Path | None) -> list[dict[str, Any]]:
        """Create the workers; return each worker's ``info()``."""

    @abstractmethod
    def call(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every worker (concurrently where possible), in policy order."""

    @abstractmethod
    def call_one(self, index: int, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on worker ``index``; a failure raises :class:`WorkerFailed`."""

    # asynchronous use (the trainer's ``sync: async`` mode): one call in flight per worker
    def submit(self, index: int, method: str, *args: Any) -> None:
        """Start ``method(*args)`` on worker ``index`` without waiting (default: run it now)."""
        if not hasattr(self, "_done"):
            self._done: deque[tuple[int, Any]] = deque()
        self._done.append((index, self.call_one(index, method, *args)))

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

    def start(self, cfg: RunConfig, run_dir: Path | None) -> list[dict[str, Any]]:
        import torch

        from mutualrl.allocation.planner import planned_devices
        from mutualrl.exchange import ExchangeURL
        from mutualrl.worker import PolicyWorker

        threads = self.threads or cfg.threads
        if threads:
            torch.set_num_threads(threads)
        devices = planned_devices(cfg)
        if ExchangeURL.for_run(cfg.exchange, run_dir) == ExchangeURL("memory", ""):
            # a bare memory:// store is private to whoever opens it: give this run's workers one
            # shared store, named uniquely so that no earlier run's rows are visible
            import dataclasses
            import uuid

            cfg = dataclasses.replace(cfg, exchange=f"memory://run-{uuid.uuid4().hex}")
        self.workers = [PolicyWorker(cfg, i, run_dir, device=devices[i]) for i in range(len(cfg.policies))]
        return [w.info() for w in self.workers]

    def call(self, method: str, *args: Any) -> list[Any]:
        return [self.call_one(i, method, *args) for i in range(len(self.workers))]

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        w = self.workers[index]
        try:
            return getattr(w, method)(*args)
        except Exception as exc:  # name the worker; the trainer turns this into a clear stop
            raise WorkerFailed(w.name, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
