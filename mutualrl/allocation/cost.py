"""MWRA cost model: predicted work of one policy per step, calibrated online.

The prediction is in FLOPs from parameters x tokens (attention's quadratic term is ignored; at
our sequence lengths it is small next to the weights):

* rollout: ``2 * P`` per token processed with a KV cache (prompt prefill + generated tokens);
* update: ``6 * P`` per trained token per optimizer iteration (forward + backward), plus
  ``2 * P`` for the reference model when ``beta > 0``. The old log-probs (PPO's reference) are
  the first iteration's own forward pass, so they cost nothing extra.

FLOPs are turned into seconds by a per-policy, per-phase factor: *core-seconds per predicted
FLOP*, starting from a generic prior and then an exponential moving average of what the workers
measure (``rollout_s`` / ``update_s`` of their step metrics, which contain ``generate_s`` /
``train_s`` plus the overheads around them, so rewards, publishing and THL are charged too).
Core-seconds are converted to wall seconds for a share of ``s`` cores with Amdahl's law,
``t(s) = t1 * ((1 - f) + f / s)``, ``f`` = :attr:`CostModel.parallel_fraction`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mutualrl import zoo
from mutualrl.algorithms.sharing import parse_strategy
from mutualrl.allocation.data_parallel import CPU_ALLREDUCE_GB_S, allreduce_seconds, lora_params
from mutualrl.config import RunConfig
from mutualrl.config.modelref import ModelRef
from mutualrl.config.resolve import step_settings

PRIOR_CORE_S_PER_FLOP = 1.0e-10
"""Prior: 10 GFLOP/s per CPU core, before any measurement."""
PRIOR_GPU_S_PER_FLOP = 1.0e-13
"""Prior for a whole GPU (about 10 TFLOP/s effective)."""
PROMPT_TOKENS_GUESS = 16
"""Prompt length assumed before any measurement (tokens)."""


@dataclass
class PhaseCost:
    """Predicted FLOPs of one policy's rollout and update for one step."""

    rollout_flops: float
    update_flops: float
    score_flops: float = 0.0
    """The scoring phase (a strategy's ``serve``: one forward over the peers' samples), priced with
    the update, on the same worker."""

    @property
    def total_flops(self) -> float:
        return self.rollout_flops + self.update_flops + self.score_flops


def rollout_flops(params: int, prompts: int, generations: int, prompt_tokens: float,
                  completion_tokens: float) -> float:
    """FLOPs of sampling ``prompts x generations`` completions with a KV cache."""
    return 2.0 * params * prompts * generations * (prompt_tokens + completion_tokens)


def update_flops(params: int, sequences: float, tokens_per_sequence: float, num_iterations: int,
                 beta: float = 0.0) -> float:
    """FLOPs of one GRPO update on ``sequences`` sequences (iterations + frozen reference)."""
    per_token = 6.0 * num_iterations + (2.0 if beta > 0 else 0.0)
    return per_token * params * sequences * tokens_per_sequence


def predict_step(cfg: RunConfig, index: int, params: int, prompt_tokens: float = PROMPT_TOKENS_GUESS,
                 settings: Mapping[str, Any] | None = None) -> PhaseCost:
    """Predicted FLOPs of policy ``index``'s step from the config (completions at full length) and
    its sharing steps' settings (``settings``: the plan's, :attr:`~mutualrl.config.resolve.WorkerSpec.sharing`;
    None: resolved from the config the same way)."""
    g = cfg.policy_grpo(index)
    k = len(cfg.policies)
    n_seq = float(cfg.prompts_per_step * g.num_generations)
    steps = step_settings(cfg, index) if settings is None else settings
    strategy = parse_strategy(cfg.sharing.strategy)
    peer = strategy.peer_rollouts_per_prompt(steps)
    if peer and k > 1:
        n_seq += cfg.prompts_per_step * min(peer, g.num_generations * (k - 1))
    roll = rollout_flops(params, cfg.prompts_per_step, g.num_generations, prompt_tokens, g.max_completion_length)
    upd = update_flops(params, n_seq, prompt_tokens + g.max_completion_length, g.num_iterations, g.beta)
    score = 0.0
    if strategy.serves:  # one forward of this model over every peer's samples
        score = sum(2.0 * params * cfg.prompts_per_step * cfg.policy_grpo(j).num_generations
                    * (prompt_tokens + cfg.policy_grpo(j).max_completion_length) for j in range(k) if j != index)
    return PhaseCost(roll, upd, score)


def _core_seconds(metrics: dict[str, Any], keys: tuple[str, ...], cpu_s: float | None, scale: float) -> float | None:
    """A phase's work in one core's seconds: its measured CPU time, else its wall time (the first of
    ``keys`` present) over the Amdahl ``scale`` of the cores it had; None when there is neither."""
    if cpu_s is not None and cpu_s > 0:
        return cpu_s
    secs = _first(metrics, *keys)
    return secs / scale if secs is not None and secs > 0 else None


@dataclass
class _Ema:
    value: float
    n: int = 0

    def update(self, x: float, alpha: float) -> None:
        # the first measurement replaces the prior outright
        self.value = x if self.n == 0 else (1 - alpha) * self.value + alpha * x
        self.n += 1


@dataclass
class CostModel:
    """Per-policy step cost (FLOPs) and its online calibration to seconds.

    Args:
        cfg: the run config (token counts, group sizes, iterations, sharing).
        params: parameter count of each policy (``None`` entries: unknown, treated as the mean).
        alpha: EMA weight of a new measurement.
        parallel_fraction: Amdahl fraction ``f`` used to scale between core shares.
    """

    cfg: RunConfig
    params: list[int | None]
    alpha: float = 0.5
    parallel_fraction: float = 0.9
    prompt_tokens: float = PROMPT_TOKENS_GUESS
    _roll: list[_Ema] = field(default_factory=list)
    _upd: list[_Ema] = field(default_factory=list)
    _kappa: list[_Ema] = field(default_factory=list)
    _comm: list[_Ema] = field(default_factory=list)
    """Per policy: seconds of its gradient all-reduce per second a 1 GB/s ring would take (1 / GB/s)."""
    act_bytes_per_token: list[float | None] = field(default_factory=list)
    """Per policy: the update's activation bytes per forward token its worker measured (the memory price)."""
    settings: list[Mapping[str, Any]] = field(default_factory=list)
    """Per policy: its sharing steps' settings (the plan's :attr:`~mutualrl.config.resolve.WorkerSpec.sharing`,
    its own ``policies[i].sharing`` overrides included); default: resolved from ``cfg``."""

    def __post_init__(self) -> None:
        k = len(self.cfg.policies)
        if len(self.params) != k:
            raise ValueError(f"params has {len(self.params)} entries for {k} policies")
        if not self._roll:
            self._roll = [_Ema(PRIOR_CORE_S_PER_FLOP) for _ in range(k)]
            self._upd = [_Ema(PRIOR_CORE_S_PER_FLOP) for _ in range(k)]
            self._kappa = [_Ema(1.0) for _ in range(k)]
        if not self._comm:
            self._comm = [_Ema(1.0 / CPU_ALLREDUCE_GB_S) for _ in range(k)]
        if not self.act_bytes_per_token:
            self.act_bytes_per_token = [None] * k
        if not self.settings:
            self.settings = [step_settings(self.cfg, i) for i in range(k)]

    # ------------------------------------------------------------------ predictions
    def effective_params(self, index: int) -> int:
        """Parameters of policy ``index`` (the mean of the known ones if unknown)."""
        p = self.params[index]
        if p:
            return int(p)
        known = [q for q in self.params if q]
        return int(sum(known) / len(known)) if known else 1_000_000

    def trainable_params(self, index: int) -> int:
        """What policy ``index``'s gradient all-reduce moves: every parameter, or under ``peft`` the
        LoRA adapter's (:func:`~mutualrl.allocation.data_parallel.lora_params`)."""
        peft = self.cfg.policies[index].peft
        n = self.effective_params(index)
        return n if peft is None else lora_params(n, peft.r, peft.target_modules)

    def flops(self, index: int) -> PhaseCost:
        """Predicted FLOPs of policy ``index`` for one step."""
        return predict_step(self.cfg, index, self.effective_params(index), self.prompt_tokens,
                            self.settings[index])

    def core_seconds(self, index: int) -> tuple[float, float]:
        """Predicted (rollout, update) busy time of policy ``index`` on one whole core.

        Work (CPU time per FLOP) times the policy's *scaling correction* ``kappa``: measured busy
        wall time ÷ the wall time predicted for the share it had (1 until measured). It absorbs
        what Amdahl's law with one global ``f`` gets wrong for this policy (threads that do not
        pay off, contention), so successive re-plans converge on balanced busy times.
        """
        c = self.flops(index)
        k = self._kappa[index].value
        return c.rollout_flops * self._roll[index].value * k, (c.update_flops + c.score_flops) * self._upd[index].value * k

    def seconds(self, index: int, cores: float) -> tuple[float, float]:
        """Predicted (rollout, update) busy time with a share of ``cores`` cores (Amdahl)."""
        r, u = self.core_seconds(index)
        factor = self.scale(cores)
        return r * factor, u * factor

    def scale(self, cores: float) -> float:
        """Wall time on ``cores`` cores relative to one core."""
        f = self.parallel_fraction
        return (1.0 - f) + f / max(cores, 1e-6)

    def allreduce_s(self, index: int, ranks: int) -> float:
        """Predicted seconds of policy ``index``'s gradient all-reduce over ``ranks`` CPU workers: the
        ring's bytes at the bandwidth its ranks measured (:data:`CPU_ALLREDUCE_GB_S` until then)."""
        return allreduce_seconds(self.trainable_params(index), ranks, 1.0) * self._comm[index].value

    @property
    def calibrated(self) -> bool:
        """True once every policy has at least one measured rollout and update."""
        return all(e.n > 0 for e in self._roll + self._upd)

    @property
    def measurements(self) -> int:
        """The smallest number of measured steps over policies and phases."""
        return min(e.n for e in self._roll + self._upd)

    # ------------------------------------------------------------------ calibration
    def observe(self, index: int, rollout: dict[str, Any] | None, update: dict[str, Any] | None,
                cores: float, rollout_cpu_s: float | None = None, update_cpu_s: float | None = None,
                shard: int = 1, rank_times: int = 1) -> None:
        """Fold one step's worker metrics (measured with a share of ``cores``) into the calibration.

        The work of a phase is the CPU time the worker process spent in it (``*_cpu_s``, summed
        over its threads) when the scheduler measured it -- this does not depend on how many
        cores the worker really got; otherwise ``rollout_s`` (``generate_s``) and ``update_s``
        (``train_s``) of the metrics are converted to one core with Amdahl's law at ``cores``.
        FLOPs use the measured token counts (``gen_tokens``, ``train_tokens``).

        A policy on N ranks is priced as N times one rank's step on its share of the cores (the
        planner divides by N again). ``shard``: the metrics are of one rank's part of the step
        (``1/shard`` of its prompts: the calibration), so times, CPU and token counts all stand for
        ``1/shard`` of the step. ``rank_times``: the metrics are the ranks' merged reply (counts and
        CPU summed over the ranks, wall times the slowest rank's, ``cores`` one rank's share), so only
        the wall times stand for ``1/rank_times`` of the step.
        """
        act = (update or {}).get("act_bytes_per_token")
        if isinstance(act, (int, float)) and math.isfinite(act) and act > 0:  # the largest seen: the peak's
            self.act_bytes_per_token[index] = max(float(act), self.act_bytes_per_token[index] or 0.0)
        if update is not None and rank_times > 1:
            update, update_cpu_s = self._fold_allreduce(index, update, update_cpu_s, rank_times)
        times = ("rollout_s", "generate_s", "update_s", "train_s")
        counts = ("gen_tokens", "train_tokens", "prp_peer_samples", "scored_tokens")
        if shard > 1 or rank_times > 1:
            def whole(d: dict[str, Any] | None) -> dict[str, Any] | None:
                if d is None:
                    return None
                out = dict(d)
                for k, v in d.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        out[k] = v * shard * rank_times if k in times else v * shard if k in counts else v
                return out
            rollout, update = whole(rollout), whole(update)
            rollout_cpu_s = rollout_cpu_s * shard if rollout_cpu_s else rollout_cpu_s
            update_cpu_s = update_cpu_s * shard if update_cpu_s else update_cpu_s
        p = self.effective_params(index)
        g = self.cfg.policy_grpo(index)
        scale = self.scale(cores)
        n_gen = self.cfg.prompts_per_step * g.num_generations
        if rollout:
            self._observe_rollout(index, rollout, rollout_cpu_s, scale, p, g, n_gen)
        if update:
            self._observe_update(index, update, update_cpu_s, self.scale(cores), p, g, n_gen)
        wall = (_first(rollout or {}, "rollout_s") or 0.0) + (_first(update or {}, "update_s") or 0.0)
        if wall > 0 and rollout_cpu_s and update_cpu_s:
            c = self.flops(index)
            work = c.rollout_flops * self._roll[index].value + (c.update_flops + c.score_flops) * self._upd[index].value
            self._kappa[index].update(wall / max(work * self.scale(cores), 1e-12), self.alpha)

    def _observe_rollout(self, index: int, rollout: dict[str, Any], cpu_s: float | None, scale: float, p: int,
                         g: Any, n_gen: int) -> None:
        """Fold a rollout's seconds per FLOP (its CPU time when measured, else Amdahl-scaled wall time)."""
        core_s = _core_seconds(rollout, ("rollout_s", "generate_s"), cpu_s, scale)
        if core_s is not None:
            toks = rollout.get("gen_tokens")
            gen = float(toks) / n_gen if toks else float(g.max_completion_length)
            fl = rollout_flops(p, self.cfg.prompts_per_step, g.num_generations, self.prompt_tokens, gen)
            self._roll[index].update(core_s / fl, self.alpha)

    def _observe_update(self, index: int, update: dict[str, Any], cpu_s: float | None, scale: float, p: int,
                        g: Any, n_gen: int) -> None:
        """Fold an update's seconds per FLOP (a scoring phase's forward folded in, when there was one)."""
        core_s = _core_seconds(update, ("update_s", "train_s"), cpu_s, scale)
        if core_s is None:
            return
        toks = update.get("train_tokens")
        if toks:
            n_rows = float(n_gen + (update.get("prp_peer_samples") or 0))
            fl = update_flops(p, n_rows, self.prompt_tokens + float(toks) / n_rows, g.num_iterations, g.beta)
        else:
            fl = self.flops(index).update_flops
        fl += 2.0 * p * float(update.get("scored_tokens") or 0.0)
        self._upd[index].update(core_s / max(fl, 1.0), self.alpha)

    def _fold_allreduce(self, index: int, update: dict[str, Any], cpu_s: float | None,
                        ranks: int) -> tuple[dict[str, Any], float | None]:
        """Calibrate the all-reduce from the ranks' merged update and take it out of the update's
        times (the planner adds it back per layout). Its transfer is the smallest rank's sync time
        (``allreduce_s_min``: the others' also wait for the slowest rank's compute)."""
        comm = _first(update, "allreduce_s_min", "allreduce_s")
        unit = allreduce_seconds(self.trainable_params(index), ranks, 1.0)
        if comm is None or comm <= 0 or unit <= 0:
            return update, cpu_s
        self._comm[index].update(comm / unit, self.alpha)
        out = dict(update)
        for k in ("update_s", "train_s"):
            v = _first(update, k)
            if v is not None:
                out[k] = max(0.1 * v, v - comm)
        if cpu_s:  # every rank spent about the transfer in the collective
            cpu_s = max(0.1 * cpu_s, cpu_s - comm * ranks)
        return out, cpu_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-able state: parameters, FLOPs and the calibrated factors per policy."""
        out = []
        for i, pol in enumerate(self.cfg.policies):
            c = self.flops(i)
            r, u = self.core_seconds(i)
            out.append({"policy": pol.name, "params": self.effective_params(i),
                        "rollout_flops": c.rollout_flops, "update_flops": c.update_flops, "score_flops": c.score_flops,
                        "rollout_core_s": r, "update_core_s": u,
                        "rollout_s_per_flop": self._roll[i].value, "update_s_per_flop": self._upd[i].value,
                        "scaling_correction": self._kappa[i].value,
                        "allreduce_gb_s": 1.0 / max(self._comm[i].value, 1e-12), "allreduce_measured": self._comm[i].n,
                        "measured_steps": min(self._roll[i].n, self._upd[i].n)})
        return {"parallel_fraction": self.parallel_fraction, "policies": out}


def _first(d: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


# ----------------------------------------------------------------------------- parameter counts
def count_parameters(model_ref: str) -> int | None:
    """Parameters of a model reference without loading weights (``None`` when unknown offline).

    Local directories, built zoo policies and prepared real models are read from ``config.json``
    and instantiated on the ``meta`` device; an unbuilt ``zoo:`` policy is sized from its spec
    (nothing is built or prepared); a hub id that is not cached is sized from the size its name
    states (``Qwen/Qwen2.5-7B-Instruct``: 7e9; ``SmolLM2-135M``: 1.35e8), as model names do.
    """
    try:
        ref = ModelRef.parse(model_ref)
        if ref.kind == "zoo":
            return _zoo_params(ref.name, ref.seed)
        d = ref.local_dir()
        if d is not None and (d / "config.json").is_file():
            return _dir_params(d)
    except Exception:  # noqa: BLE001 - planning must not fail on an odd model; equal cost then
        return None
    return params_from_name(model_ref)


def params_from_name(name: str) -> int | None:
    """The parameter count a model's name states (``...-1.5B-...`` -> 1.5e9, ``...-270m`` -> 2.7e8), or None."""
    found = re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z])", name.rsplit("/", 1)[-1])
    if not found:
        return None
    value, unit = found[-1]
    return int(float(value) * (1e9 if unit in "Bb" else 1e6))


def _meta_count(build: Any) -> int:
    with torch.device("meta"):
        model = build()
    return int(sum(p.numel() for p in model.parameters()))


def _dir_params(path: Path) -> int | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    json.loads((path / "config.json").read_text())  # fail early on a broken file
    cfg = AutoConfig.from_pretrained(str(path))
    return _meta_count(lambda: AutoModelForCausalLM.from_config(cfg))


class _SizedTokenizer:
    """Just enough of a tokenizer for :func:`mutualrl.zoo.build_model` to size a model."""

    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _zoo_params(name: str, seed: int) -> int | None:
    spec = zoo.ZOO.get(name)
    if spec is None:
        return None
    try:
        built = zoo.policy_dir(name, seed)
        if (built / "config.json").is_file():
            return _dir_params(built)
    except Exception:  # noqa: BLE001, S110 - fall back to the spec
        pass
    return _meta_count(lambda: zoo.build_model(spec, _SizedTokenizer(spec.vocab_size)))


def estimate_parameters(cfg: RunConfig) -> list[int | None]:
    """:func:`count_parameters` for every policy of a run."""
    return [count_parameters(p.model) for p in cfg.policies]
