"""GPU memory of worker processes that share one GPU: their shares, and the allocator setting.

The plan gives each worker on a shared GPU a fraction of it proportional to its predicted work
(:attr:`~mutualrl.allocation.planner.Placement.gpu_fraction`, the fractions of one GPU summing to
1). As a memory cap (``torch.cuda.set_per_process_memory_fraction``) that leaves nothing for what
the caching allocator does not see: every process's CUDA context (a few hundred MiB each), NCCL
buffers, cuBLAS workspaces and fragmentation. :func:`memory_shares` scales the shares of each GPU
so they sum to at most :data:`GPU_MEMORY_HEADROOM`; :func:`allocator_env` is the environment a
worker process on a GPU is started with (``expandable_segments`` lets the allocator grow and
shrink segments instead of keeping fragmented blocks that count against the share).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

GPU_MEMORY_HEADROOM = 0.9
"""The most the memory shares of the worker processes on one GPU may sum to."""

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The caching allocator's settings (every torch version reads it; torch >= 2.9 also
``PYTORCH_ALLOC_CONF``)."""
EXPANDABLE = "expandable_segments:True"


def memory_shares(shares: Sequence[tuple[Hashable, float | None]],
                  headroom: float = GPU_MEMORY_HEADROOM) -> list[float | None]:
    """The memory share of each worker process, given ``(gpu, share)`` per process.

    ``gpu`` identifies one physical GPU (e.g. ``(node, index)``; ``None``: the CPU) and ``share`` is
    the planned fraction of it (``None``: no cap, the process has the GPU to itself). The capped
    shares of one GPU are scaled together so that they sum to at most ``headroom``; a GPU whose
    shares already do is left alone. Order is kept; ``None`` stays ``None``.
    """
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    total: dict[Hashable, float] = defaultdict(float)
    for gpu, share in shares:
        if gpu is not None and share is not None:
            if not 0 < share <= 1:
                raise ValueError(f"a GPU memory share must be in (0, 1], got {share} (GPU {gpu})")
            total[gpu] += share
    out: list[float | None] = []
    for gpu, share in shares:
        if gpu is None or share is None:
            out.append(None)
            continue
        scale = min(1.0, headroom / total[gpu])
        out.append(round(share * scale, 6))
    return out


def allocator_env(environ: Mapping[str, str], engine: str = "hf") -> dict[str, str]:
    """The variables to add to ``environ`` for a worker process on a GPU: the caching allocator's
    ``expandable_segments:True``, unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` (or torch's newer
    name ``PYTORCH_ALLOC_CONF``): theirs is kept as is; none for a worker whose policy samples with
    vLLM (``engine``), whose sleep-mode memory pool refuses to start beside expandable segments."""
    if engine == "vllm" or ALLOC_CONF in environ or "PYTORCH_ALLOC_CONF" in environ:
        return {}
    return {ALLOC_CONF: EXPANDABLE}
