"""The remote surface of a policy worker: exactly what a scheduler may call on it, typed.

:class:`~mutualrl.run.worker.PolicyWorker` implements :class:`WorkerAPI`; the schedulers proxy it
(in this process, over a pipe to a worker process, or to a Ray actor). The controller names a
call by the protocol's method itself, ``scheduler.call(WorkerAPI.rollout, step)``, so "go to
definition" finds it and a typo fails when the line is read, not in a worker; on the far side only
these names are served (like verl's ``@register`` on worker methods). Arguments and results are
JSON values: step numbers, paths as strings, metric dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class WorkerAPI(Protocol):
    """What the controller calls on each policy worker."""

    def rollout(self, step: int) -> dict[str, float]:
        """Sample the step's groups, score them and publish them to the exchange; the metrics."""
        ...

    def serve(self, step: int) -> dict[str, float]:
        """Work for the peers after every policy's rollouts of ``step`` and before the updates (the
        strategy's ``serve`` hooks, e.g. ``distill``'s scores of the peers' samples); the metrics."""
        ...

    def update(self, step: int) -> dict[str, float]:
        """Read the peers' rows, build the strategy's batch and train on it; the metrics."""
        ...

    def evaluate(self, n: int | None = None, split: str = "test") -> dict[str, float]:
        """Greedy accuracy on held-out problems of ``split`` (``test`` or ``val``; ``n`` of them, default
        the run's ``eval_size``)."""
        ...

    def save(self, directory: str) -> None:
        """Write the policy's weights, optimizer and RNG states into ``directory``."""
        ...

    def load(self, directory: str) -> None:
        """Restore what :meth:`save` wrote."""
        ...

    def exchange_position(self) -> int:
        """The exchange's position (recorded in checkpoints)."""
        ...

    def exchange_discard_after(self, position: int) -> int:
        """Drop exchange rows written after ``position``; how many were dropped."""
        ...

    def info(self) -> dict[str, Any]:
        """What the worker runs: sizes, tokenizer, device, dtype, engine, process id."""
        ...

    def set_threads(self, n: int) -> int:
        """Change the worker's torch threads; the count in force."""
        ...


REMOTE_METHODS: frozenset[str] = frozenset(
    name for name, value in vars(WorkerAPI).items() if callable(value) and not name.startswith("_"))
"""The names a worker serves to its scheduler (nothing else is remotely callable)."""

WorkerMethod = Callable[..., Any]
"""A method of :class:`WorkerAPI` (``WorkerAPI.rollout``), or its name."""


def remote_name(method: WorkerMethod | str) -> str:
    """The name of a :class:`WorkerAPI` method given as the method or its name; ``ValueError`` for
    anything the worker does not serve."""
    name = method if isinstance(method, str) else getattr(method, "__name__", "")
    if name not in REMOTE_METHODS:
        raise ValueError(f"{name or method!r} is not a worker method; the remote surface is "
                         f"{', '.join(sorted(REMOTE_METHODS))} (mutualrl.run.worker_api.WorkerAPI)")
    return name
