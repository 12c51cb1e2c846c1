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
BUCKET_ELEMENTS = 1 << 24
"""Gradient values per all-reduce bucket (64 MiB in fp32): the copy a bucket needs stays small."""


def lagging_rank(store: dist.Store, prefix: str, world: int) -> int | None:
    """The rank of the policy under ``prefix`` that is behind the others in the collectives they
    reach (:func:`progress`): the one the others wait for; None when none is behind."""
    marks = progress(store, prefix, world)
    behind = min(range(world), key=marks.__getitem__)
    return behind if marks[behind] < max(marks) else None


def progress(store: dist.Store, prefix: str, world: int) -> list[int]:
    """Collectives each rank of the policy under ``prefix`` reached (:meth:`RankGroup.mark`), from the
    scheduler's own store; 0 for a rank that never marked."""
    keys = dist.PrefixStore(f"{STORE_PREFIX}/{prefix}/ranks", store)
    return [int(keys.add(f"progress/{r}", 0)) for r in range(world)]


@dataclass(frozen=True)
class Rendezvous:
    """Where a policy's ranks meet: the controller's ``TCPStore`` and the policy's key prefix.

    Written as ``tcp://HOST:PORT/PREFIX`` in a worker's spec (:attr:`~mutualrl.config.resolve.WorkerSpec.rendezvous`)."""

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
        self.store: dist.Store | None = None
        """The policy's key space in the scheduler's store (progress marks)."""
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
        self.store = dist.PrefixStore("ranks", prefixed)
        extra: dict[str, object] = {}
        if self.device.type == "cuda":
            # the rank's GPU becomes the current device before anything collective: FSDP2's mesh and nccl's
            # communicator take the current device, which would otherwise be cuda:0 on every rank
            self.device = torch.device("cuda", self.device.index if self.device.index is not None else 0)
            torch.cuda.set_device(self.device)
            extra["device_id"] = self.device
        dist.init_process_group(backend_for(self.device), store=prefixed, rank=rank, world_size=world, timeout=timeout,
                                **extra)
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
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        """``values`` maximised element-wise over the ranks (float64 on the wire)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        if not self.active:
            return [float(v) for v in values]
        self.mark()
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return [float(v) for v in t.tolist()]

    def any(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks."""
        return [v > 0 for v in self.sum([1.0 if f else 0.0 for f in flags])]

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the ranks in place, in buckets of at most
        :data:`BUCKET_ELEMENTS` values. A parameter with a gradient on no rank keeps none (as with one
        worker: the optimizer skips it); one with a gradient on some ranks counts as zero on the
        others (a rank without rows of a phase still takes part)."""
        if not self.active:
            return
        t0 = time.perf_counter()
        ps = [p for p in params if p.requires_grad]
        self.mark()
        has = torch.tensor([p.grad is not None for p in ps], dtype=torch.float32, device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.SUM)
        ps = [p for p, h in zip(ps, has.tolist(), strict=True) if h > 0]
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in ps + [None]:  # type: ignore[list-item]
            if p is not None and (not bucket or size + p.numel() <= BUCKET_ELEMENTS):
                bucket.append(p)
                size += p.numel()
                continue
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])  # type: ignore[union-attr]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for q in bucket:
                n = q.numel()
                q.grad.copy_(flat[offset:offset + n].view_as(q.grad))  # type: ignore[union-attr]
                offset += n
            bucket, size = ([p], p.numel()) if p is not None else ([], 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.gradient_sync_s += time.perf_counter() - t0

    def mark(self) -> None:
        """Count one more collective reached by this rank (``progress/<rank>`` in the policy's store):
        when the ranks stop, the one whose count is behind is the one the others wait for."""
        if self.store is not None:
            self.store.add(f"progress/{self.rank}", 1)

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Every rank takes rank 0's parameters and buffers (identical starts)."""
        if not self.active:
            return
        self.mark()
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
