"""The ranks of one policy: ``torch.distributed`` for a policy trained by several data-parallel workers.

A policy with ``workers: N`` (N > 1) runs N worker processes (local scheduler) or Ray actors (Ray
scheduler), its *ranks*. They form one process group of their own (``gloo`` on the CPU, ``nccl`` on
GPUs) through a ``TCPStore`` the controller serves (each policy under its own key prefix), so a rank
never needs to know where rank 0 lives. What crosses between ranks are tensors only (no objects, no
pickle), and every collective has the run's ``step_timeout_s`` as its timeout: a lost rank makes the
others fail with an error instead of waiting forever, and the scheduler names the policy and rank.

What the ranks agree on (:class:`RankGroup`):

- at start, rank 0's parameters (:meth:`RankGroup.broadcast_parameters`): a randomly initialised
  adapter or head starts identical on every rank;
- per step, the reductions' denominators (:meth:`RankGroup.sum`: rows, tokens and prompts of the
  whole step), the batch reward moments (``scale_rewards: batch``), which optimizer phases have rows
  anywhere (:meth:`RankGroup.any`), whether another resampling round is needed;
- per optimizer step, the gradient: summed over the ranks (:meth:`RankGroup.sum_gradients`, one
  flat buffer). The loss of each rank is its rows' share of the whole step's loss (each term
  reduced over the global counts), so the summed gradient is the one a single worker computes on
  the whole batch, and every rank takes the same optimizer step.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

STORE_PREFIX = "mutualrl"


@dataclass(frozen=True)
class Rendezvous:
    """Where a policy's ranks meet: the controller's ``TCPStore`` and the policy's key prefix.

    Written as ``tcp://HOST:PORT/PREFIX`` in a worker's spec (:attr:`~mutualrl.resolve.WorkerSpec.rendezvous`)."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        return f"tcp://{self.host}:{self.port}/{self.prefix}"

    @classmethod
    def parse(cls, url: str) -> Rendezvous:
        """Inverse of ``str()``; ``ValueError`` naming the expected form."""
        if not url.startswith("tcp://") or "/" not in url[6:]:
            raise ValueError(f"rendezvous must look like tcp://HOST:PORT/PREFIX, got {url!r}")
        where, prefix = url[6:].split("/", 1)
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit() or not prefix:
            raise ValueError(f"rendezvous must look like tcp://HOST:PORT/PREFIX, got {url!r}")
        return cls(host, int(port), prefix)


def serve_store(host: str = "127.0.0.1", timeout_s: float = 600.0) -> dist.TCPStore:
    """A ``TCPStore`` server on a free port of ``host`` (its ``.port``), for the ranks of every policy
    of a run to meet through (the controller holds it for the run's life)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s))


def backend_for(device: str | torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class RankGroup:
    """This process's place among its policy's ranks (a no-op group of one when ``world`` is 1).

    Args:
        rank: this worker's rank (0 .. world-1).
        world: the policy's number of ranks.
        rendezvous: ``tcp://HOST:PORT/PREFIX`` (needed when ``world`` > 1).
        device: the device the policy computes on (chooses the backend, holds the buffers).
        timeout_s: every collective's timeout (the run's ``step_timeout_s``).
    """

    def __init__(self, rank: int = 0, world: int = 1, rendezvous: str | None = None, device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.initialized = False
        self.gradient_sync_s = 0.0
        """Seconds spent summing gradients so far (the all-reduce's share of a step)."""
        if world == 1:
            return
        if rendezvous is None:
            raise ValueError("a policy on several workers needs a rendezvous (the scheduler's TCPStore)")
        rv = Rendezvous.parse(rendezvous)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(rv.host, rv.port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{rv.prefix}", store)
        dist.init_process_group(backend_for(self.device), store=prefixed, rank=rank, world_size=world, timeout=timeout)
        self.initialized = True

    @property
    def active(self) -> bool:
        """Whether there are other ranks to agree with."""
        return self.world > 1

    def shard(self, items: Sequence[object]) -> list[object]:
        """This rank's part of ``items``: every ``world``-th from position ``rank`` (groups stay whole)."""
        return list(items[self.rank::self.world])

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over the ranks (float64 on the wire)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def any(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks."""
        return [v > 0 for v in self.sum([1.0 if f else 0.0 for f in flags])]

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the ranks in place (a missing gradient counts as zero,
        so a rank without rows of a phase still takes part), in one flat buffer."""
        if not self.active:
            return
        t0 = time.perf_counter()
        ps = [p for p in params if p.requires_grad]
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in ps:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        self.gradient_sync_s += time.perf_counter() - t0

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Every rank takes rank 0's parameters and buffers (identical starts)."""
        if not self.active:
            return
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)

    def close(self) -> None:
        """Leave the process group (best effort)."""
        if self.initialized:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - the others may be gone already
                pass
            self.initialized = False
