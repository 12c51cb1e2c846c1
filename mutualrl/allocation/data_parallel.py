"""MWRA over ranks: how many data-parallel workers each policy gets, and what a step costs on them.

A policy's step on N ranks costs its single-worker compute over N plus the gradient all-reduce
(a ring: each rank sends and receives ``2 (N - 1) / N`` times the trainable weights' bytes). On
GPUs the planner gives every policy whole GPUs: a policy with ``workers: N`` keeps N, and the
GPUs left go to the ``workers: auto`` policies one at a time, each to the policy whose predicted
step is slowest while that shortens it (the step is as slow as the slowest policy), so two
policies of 7B and 1.5B parameters on 8 GPUs get 6 + 2. A policy has at most ``prompts_per_step``
ranks (a prompt each). On CPU cores an ``auto`` policy gets the number of ranks, up to its threads,
whose predicted step is shortest (ranks shrink the part of the work threads do not speed up and add
the all-reduce; ``benchmarks/data_parallel.py`` measures both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mutualrl.config import RunConfig

GPU_ALLREDUCE_GB_S = 100.0
"""Bus bandwidth of a GPU all-reduce within a node (NVLink-class; PCIe is ~10x less), GB/s."""
CPU_ALLREDUCE_GB_S = 1.0
"""Bandwidth of a gloo all-reduce between processes of one machine, GB/s, the prior until a run's ranks
measure theirs: SmolLM2-135M's 540 MB of fp32 gradients took 0.51 s between 2 ranks on a 2-core Xeon
(1.1 GB/s) and 0.60 s on a 2-core AMD EPYC (0.9 GB/s, ``benchmarks/results/data_parallel.json``)."""


def allreduce_seconds(trainable_params: int, ranks: int, gb_s: float, bytes_per_param: int = 4) -> float:
    """Predicted time of one ring all-reduce of the gradients over ``ranks`` workers."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * trainable_params * bytes_per_param / (gb_s * 1e9)


def lora_params(params: int, r: int, target_modules: Sequence[str] | str) -> int:
    """An estimate of a LoRA adapter's parameters (what the ranks' all-reduce moves under ``peft``)
    from the base model's size: width ``h`` and depth from ``params ~ 12 layers h^2`` with
    ``layers ~ h / 128`` (Llama-7B: 4,210 and 33 for 4,096 and 32), ``r (in + out)`` a projection with
    ``in + out ~ 3 h`` on average (attention h + h, the MLP's h + 4 h), 7 projections a block for
    ``all-linear``. Within ~15 % of Mistral-7B's 41.9 M at r = 16."""
    hidden = (max(params, 1) * 128 / 12) ** (1 / 3)
    layers = max(1, round(hidden / 128))
    per_block = 7 if isinstance(target_modules, str) else max(1, len(target_modules))
    return int(r * 3 * hidden * per_block * layers)


def fixed_ranks(cfg: RunConfig) -> list[int | None]:
    """Each policy's ``workers`` when it is a number, None for ``auto``."""
    return [p.workers if isinstance(p.workers, int) else None for p in cfg.policies]


def split_devices(step_s: Sequence[float], devices: int, fixed: Sequence[int | None],
                  comm_s: Callable[[int, int], float], most: int | None = None) -> list[int]:
    """Whole devices per policy: ``fixed`` counts kept, the rest of ``devices`` given out greedily.

    ``step_s[i]``: policy ``i``'s step on one device; ``comm_s(i, n)``: its all-reduce on ``n``;
    ``most``: the most ranks a policy may have (``prompts_per_step``: a prompt each at least). Every
    ``auto`` policy gets at least one device; each further device goes to the policy whose predicted
    step ``step_s[i] / n + comm_s(i, n)`` is the largest, if one more shortens it. Devices no policy
    gains from stay unused.
    """
    counts = [f if f is not None else 1 for f in fixed]
    left = devices - sum(counts)

    def predicted(i: int, n: int) -> float:
        return step_s[i] / n + comm_s(i, n)

    while left > 0:
        best: tuple[float, int] | None = None
        for i, f in enumerate(fixed):
            if f is not None:
                continue
            n = counts[i] + 1
            if (most is not None and n > most) or predicted(i, n) >= predicted(i, counts[i]):
                continue
            if best is None or predicted(i, counts[i]) > best[0]:
                best = (predicted(i, counts[i]), i)
        if best is None:
            break
        counts[best[1]] += 1
        left -= 1
    return counts
