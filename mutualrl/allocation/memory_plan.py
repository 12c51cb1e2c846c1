"""MWRA's memory plan: every policy's price (:mod:`mutualrl.allocation.memory`) from its model's
shape, the memory each worker is given, the micro-batch budget that fits it, a vLLM engine's share
of its GPU, and the table ``mutualrl plan`` prints. The placement step writes the result into each
worker's spec (:func:`mutualrl.allocation.placement.place`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutualrl.allocation.data_parallel import lora_params
from mutualrl.allocation.memory import (
    CPU_HEADROOM,
    GPU_HEADROOM,
    PROCESS_BYTES,
    MemoryPlanError,
    MemoryPrice,
    ModelShape,
    check_fits,
    cpu_allowances,
    gib,
    group_tokens,
    price,
)
from mutualrl.config.modelref import ModelRef

VLLM_SLACK = 0.9
"""A derived vLLM share takes this much of what training leaves the worker (the rest: the allocator's
slack inside the process's memory cap)."""
PROMPT_TOKENS_PLAN = 64
"""Prompt tokens assumed per row when the plan prices a step (chat templates run 30-100)."""


def model_shape(model_ref: str, peft: Any = None) -> ModelShape | None:
    """The shape of a model reference without loading weights (a local directory, a built or unbuilt
    zoo policy, a prepared real model), or None where only a name is known offline. ``peft``: a
    :class:`~mutualrl.config.PeftConfig` (the adapter's parameters are then the trainable ones)."""
    from mutualrl.allocation.cost import count_parameters  # torch

    params = count_parameters(model_ref)
    if not params:
        return None
    trainable = lora_params(params, peft.r, peft.target_modules) if peft is not None else params
    try:
        ref = ModelRef.parse(model_ref)
        config = None
        if ref.kind == "zoo":
            from mutualrl.zoo import ZOO, build_model, policy_dir  # torch

            spec = ZOO.get(ref.name)
            built = policy_dir(ref.name, ref.seed)
            if (built / "config.json").is_file():
                config = _auto_config(built)
            elif spec is not None:
                import torch

                from mutualrl.allocation.cost import _SizedTokenizer

                with torch.device("meta"):
                    config = build_model(spec, _SizedTokenizer(spec.vocab_size)).config
        else:
            d = ref.local_dir()
            if d is not None and (d / "config.json").is_file():
                config = _auto_config(d)
    except Exception:  # noqa: BLE001 - an odd reference: price from the parameter count alone
        config = None
    if config is None:
        return _shape_from_params(params, trainable)
    return ModelShape.from_config(config, params, trainable)


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _shape_from_params(params: int, trainable: int) -> ModelShape:
    """A dense transformer of ``params`` parameters as such models are usually shaped (``params ~ 12
    layers h^2``, ``layers ~ h / 128``, MLP 4 h wide, 128-wide heads, a quarter of them for keys and
    values, a 128k vocabulary)."""
    hidden = int((max(params, 1) * 128 / 12) ** (1 / 3))
    heads = max(1, hidden // 128)
    return ModelShape(params, trainable, max(1, round(hidden / 128)), hidden, 4 * hidden, heads, max(1, heads // 4),
                      128, 128_000)


@dataclass(frozen=True)
class PolicyMemory:
    """One worker's memory in the plan: its price, what it is given, the budget it runs with."""

    name: str
    price: MemoryPrice | None
    """None where the model's shape is unknown offline (its worker prices it once loaded)."""
    allowance: int
    micro_batch_tokens: int | None
    longest_row: int
    vllm_memory_fraction: float | None = None
    """A vLLM engine's ``gpu_memory_utilization`` on a GPU: the share of the card the plan leaves it."""

    @property
    def predicted_peak(self) -> int | None:
        return None if self.price is None else self.price.peak(self.micro_batch_tokens or self.longest_row)

    @property
    def predicted_resident(self) -> int | None:
        """The bytes of the peak held between phases (:attr:`MemoryPrice.resident`)."""
        return None if self.price is None else self.price.resident

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "allowance": self.allowance, "micro_batch_tokens": self.micro_batch_tokens,
                "predicted_peak": self.predicted_peak, "vllm_memory_fraction": self.vllm_memory_fraction,
                "price": self.price.to_dict() if self.price is not None else None}


def plan_memory(plan: Any, gpu_bytes: list[int | None], ranks: list[int], concurrent: bool,
                shares: list[float | None] | None = None, total: int | None = None,
                act_bytes_per_token: list[float | None] | None = None,
                gpu_ids: list[Any] | None = None) -> list[PolicyMemory]:
    """Every policy's memory in a plan (one entry per policy; its ranks are alike).

    ``gpu_bytes``: the memory of the GPU each policy's worker is on (None: CPU); ``shares``: its
    share of that GPU; ``concurrent``: whether the workers' updates can overlap (separate
    processes; in one process the policies on one device share its pool, the process counted once);
    ``gpu_ids``: which GPU each is on; ``act_bytes_per_token``: measurements (calibration) per
    policy. A policy whose shape is unknown offline (a hub id not in the cache) is not priced: its
    worker resolves ``auto`` against its loaded model. Raises :class:`MemoryPlanError` for the first
    policy that cannot fit, naming the levers. ``plan``: a :class:`~mutualrl.config.resolve.RunPlan` (each
    policy's effective options are its first worker's)."""
    cfg = plan.config
    k = len(cfg.policies)
    opts = {w.index: w.options for w in reversed(plan.workers)}
    sharing = {w.index: w.sharing for w in reversed(plan.workers)}
    longest = [PROMPT_TOKENS_PLAN + opts[i].max_completion_length for i in range(k)]
    prices = _prices(cfg, opts, sharing, gpu_bytes, ranks, act_bytes_per_token or [None] * k, longest)
    known = [i for i in range(k) if prices[i] is not None]
    allowance, pools = _allowances(prices, known, gpu_bytes, ranks, concurrent, shares or [None] * k, total,
                                   gpu_ids or [0] * k)
    budgets: dict[int, int | None] = {}
    for i in known:
        field = f"policies[{i}].grpo.micro_batch_tokens"
        budgets[i] = check_fits(cfg.policies[i].name, prices[i], allowance[i], opts[i].micro_batch_tokens,  # type: ignore[arg-type]
                                longest[i], field, group_tokens(opts[i].num_generations, opts[i].max_completion_length))
    fracs = _vllm_shares(cfg, prices, allowance, budgets, longest, gpu_bytes, pools)
    out = []
    for i, pol in enumerate(cfg.policies):
        p = prices[i]
        if p is None:
            out.append(PolicyMemory(pol.name, None, 0, None, longest[i]))
            continue
        if fracs.get(i) is not None:
            p = dataclasses.replace(p, sampler_copy=int(fracs[i] * gpu_bytes[i]))  # type: ignore[operator]
        out.append(PolicyMemory(pol.name, p, allowance[i], budgets[i], longest[i], fracs.get(i)))
    return out


def _prices(cfg: Any, opts: dict[int, Any], sharing: dict[int, Any], gpu_bytes: list[int | None], ranks: list[int],
            acts: list[float | None], longest: list[int]) -> list[MemoryPrice | None]:
    """Each policy's price with its effective options ``opts`` and sharing settings ``sharing`` (its
    worker's, as the plan resolved them; None where its shape is unknown offline)."""
    prices: list[MemoryPrice | None] = []
    for i, pol in enumerate(cfg.policies):
        o, shape, n, gpu = opts[i], model_shape(pol.model, pol.peft), max(1, ranks[i]), gpu_bytes[i] is not None
        # the sampler decodes a step's rows at once (an evaluation, eval_batch_size of them)
        rows = max(cfg.prompts_per_step * o.num_generations // n, min(cfg.eval_batch_size, cfg.eval_size))
        prices.append(None if shape is None else price(
            shape, phases=1 + _sharing_phases(cfg, sharing[i]), beta=o.beta, lora=pol.peft is not None,
            checkpointing=o.gradient_checkpointing, sampler=pol.generation.engine, sample_rows=rows,
            sample_tokens=longest[i], fsdp_ranks=n if pol.fsdp else 1, gpu=gpu, gpu_bytes=gpu_bytes[i],
            act_bytes_per_token=acts[i], packed_weights=bool(pol.generation.packed_weights),
            bf16=o.dtype == "bfloat16" or (o.dtype == "auto" and gpu)))
    return prices


def _allowances(prices: list[MemoryPrice | None], known: list[int], gpu_bytes: list[int | None], ranks: list[int],
                concurrent: bool, shares: list[float | None], total: int | None,
                gpu_ids: list[Any]) -> tuple[dict[int, int], dict[Any, list[int]]]:
    """The bytes each priced policy's worker is given, and the pools (device -> policies) whose
    workers split one memory: one process (not ``concurrent``) per device; separate processes on the
    CPU. A worker alone on its GPU share gets that share."""
    device_of = [("cpu",) if gpu_bytes[i] is None else ("gpu", gpu_ids[i]) for i in range(len(prices))]
    allowance: dict[int, int] = {}
    pools: dict[Any, list[int]] = {}
    for i in known:
        if gpu_bytes[i] is not None and (concurrent or shares[i]):
            allowance[i] = int(gpu_bytes[i] * (shares[i] or GPU_HEADROOM))
        else:
            pools.setdefault(device_of[i], []).append(i)
    for dev, on in pools.items():
        cpu = dev == ("cpu",)
        res = [prices[i].resident * (max(1, ranks[i]) if cpu else 1) for i in on]  # type: ignore[union-attr]
        if not concurrent:  # one process: Python and torch once
            res = [r - (PROCESS_BYTES if j else 0) for j, r in enumerate(res)]
        got = cpu_allowances(res, concurrent and cpu, total if cpu else gpu_bytes[on[0]],
                             CPU_HEADROOM if cpu else GPU_HEADROOM)
        allowance.update({i: a // (max(1, ranks[i]) if cpu else 1) for i, a in zip(on, got, strict=True)})
    return allowance, pools


def _vllm_shares(cfg: Any, prices: list[MemoryPrice | None], allowance: dict[int, int],
                 budgets: dict[int, int | None], longest: list[int], gpu_bytes: list[int | None],
                 pools: dict[Any, list[int]]) -> dict[int, float]:
    """Each vLLM engine's share of its GPU: what its worker's allowance leaves after training (its
    resident state and one micro-batch), or, for engines of one process on one GPU, an equal part
    of what that pool leaves after every policy's resident state and the largest update; a set
    ``gpu_memory_utilization`` is checked to fit instead."""
    pooled = {i: on for on in pools.values() for i in on}
    out: dict[int, float] = {}
    for i, pol in enumerate(cfg.policies):
        p = prices[i]
        if p is None or gpu_bytes[i] is None or pol.generation.engine != "vllm":
            continue
        need = p.sampler_copy  # priced as the engine's least: its bf16 weights and a step's KV
        if i in pooled:
            on = pooled[i]
            transient = max(prices[j].peak(budgets[j] or longest[j]) - prices[j].resident for j in on)  # type: ignore[union-attr]
            engines = [j for j in on if cfg.policies[j].generation.engine == "vllm"]
            rest = need + (allowance[i] - p.resident - transient) // len(engines)
        else:
            rest = allowance[i] - (p.peak(budgets[i] or longest[i]) - need)
        util = pol.generation.gpu_memory_utilization
        if util is not None and util * gpu_bytes[i] > rest:
            raise MemoryPlanError(pol.name, f"policies[{i}].generation.gpu_memory_utilization",
                                  int(allowance[i] - rest + util * gpu_bytes[i]), allowance[i],
                                  f"vLLM asks for {util:g} of the card, training leaves {rest / gpu_bytes[i]:.2f}; "
                                  "leave gpu_memory_utilization unset to have it derived")
        out[i] = util if util is not None else VLLM_SLACK * rest / gpu_bytes[i]
    return out


def _sharing_phases(cfg: Any, settings: Any) -> int:
    """Optimizer phases a policy's sharing steps add (each its own AdamW), with its resolved step
    ``settings`` (:attr:`~mutualrl.config.resolve.WorkerSpec.sharing`)."""
    try:
        from mutualrl.algorithms.sharing import parse_strategy

        return len(parse_strategy(cfg.sharing.strategy).optimizer_phases(settings))
    except Exception:  # noqa: BLE001 - a strategy module not importable here: price one phase
        return 0


def describe_memory(entries: list[PolicyMemory]) -> str:
    """A plain-text table: each policy's predicted peak, its parts and what the plan gives it."""
    head = ["policy", "micro_batch_tokens", "predicted_peak", "given", "weights+grads+adam", "sampler", "act/token"]
    rows = []
    for e in entries:
        p = e.price
        if p is None:
            rows.append([e.name, "auto (at start)", "unknown offline", "-", "-", "-", "-"])
            continue
        rows.append([e.name, str(e.micro_batch_tokens or "whole phase"), gib(e.predicted_peak), gib(e.allowance),
                     gib(p.weights + p.gradients + p.optimizer + p.reference), gib(p.sampler_copy + p.sampler_kv),
                     f"{p.act_bytes_per_token / 1024:.0f} KiB" + ("" if p.act_measured else " (prior)")])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
    return "\n".join(["MWRA memory (per worker)", line(head), line(["-" * w for w in widths]), *map(line, rows)])
