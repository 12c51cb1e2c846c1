"""MWRA: where policy workers run (schedulers) and how resources are split between them."""

from mutualrl.allocation.base import Scheduler, SequentialScheduler, WorkerFailed


def make_scheduler(name: str, threads: int | None = None) -> Scheduler:
    """The scheduler called ``name``: ``sequential`` (in-process), ``local`` or ``ray``."""
    if name == "sequential":
        return SequentialScheduler(threads)
    if name == "local":
        from mutualrl.allocation.local import LocalScheduler

        return LocalScheduler(threads)
    if name == "ray":
        from mutualrl.allocation.ray_scheduler import RayScheduler

        return RayScheduler(threads)
    raise ValueError(f"unknown scheduler {name!r}: expected sequential, local or ray")


__all__ = ["Scheduler", "SequentialScheduler", "WorkerFailed", "make_scheduler"]
