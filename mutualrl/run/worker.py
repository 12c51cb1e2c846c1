"""A policy worker: one policy's rollout, publish, peer query, THL, strategy and update.

The controller (:class:`~mutualrl.run.trainer.MutualTrainer`) only sends step numbers; a worker
samples the step's prompts itself (deterministic in seed and step, identical for every worker),
so the same worker runs in-process, in a subprocess or as a Ray actor.

A policy with ``workers: N`` is N such workers, its data-parallel *ranks*
(:mod:`mutualrl.run.distributed`): each takes every N-th of the step's prompts (whole groups, so
advantages and the exchange's per-prompt keys are those of one worker), publishes and queries for
its own prompts, builds its part of the batch, and trains with the ranks' gradients summed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mutualrl.algorithms.context import PeerView
from mutualrl.algorithms.schedule import learning_rate_at
from mutualrl.algorithms.sharing import (
    OwnGroup,
    PeerRows,
    ShareContext,
    StepSource,
    build_batch,
    gather_context,
    parse_strategy,
    serve_peers,
)
from mutualrl.algorithms.update import train_on_batch, update_flops
from mutualrl.allocation.memory import process_peak_bytes, reset_process_peak
from mutualrl.allocation.placement import place_in_process
from mutualrl.config import RunConfig
from mutualrl.config.modelref import resolve_model_path
from mutualrl.config.resolve import RunPlan, import_strategy_modules, plan_of
from mutualrl.denormals import denormals_flushed
from mutualrl.exchange import open_exchange
from mutualrl.experience import ExperienceLimits, GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.heap import retain_freed_memory
from mutualrl.rollout.modeling import model_stop_ids, tokenizer_fingerprint
from mutualrl.rollout.policy import Policy
from mutualrl.run.checkpoint import load_policy_state, save_policy_state
from mutualrl.run.distributed import RankGroup
from mutualrl.run.faults import fault_point, log_acknowledged
from mutualrl.run.quiet import silence_transformers
from mutualrl.run.worker_api import WorkerAPI
from mutualrl.tasks.base import Problem
from mutualrl.tasks.build import build_task, eval_problems
from mutualrl.thl.peer import PeerTrace, peer_trace, represents


def _numerics(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a worker phase with denormals flushed to zero where the run asks for it (``flush_denormals``),
    the thread's setting restored afterwards."""
    @functools.wraps(method)
    def run(self: PolicyWorker, *args: Any, **kwargs: Any) -> Any:
        if not self.cfg.flush_denormals:
            return method(self, *args, **kwargs)
        with denormals_flushed():
            return method(self, *args, **kwargs)
    return run


class PolicyWorker(WorkerAPI):
    """Owns one policy and does its part of every step (the :class:`~mutualrl.run.worker_api.WorkerAPI`
    its scheduler calls; nothing else of it is remotely callable)."""

    def __init__(self, plan: RunPlan | RunConfig, index: int, run_dir: str | Path | None = None,
                 exchange: Any | None = None, rank: int = 0) -> None:
        # placed by the placement step (a scheduler's, or here for a worker built from a config)
        plan = place_in_process(plan if isinstance(plan, RunPlan) else plan_of(plan), run_dir)
        cfg, spec = plan.config, plan.spec(index, rank)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        if spec.gpu_fraction and spec.device and spec.device.startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(float(spec.gpu_fraction), torch.device(spec.device))
        if cfg.retain_freed_memory:
            retain_freed_memory()
        silence_transformers()
        self.cfg = cfg
        self.index = index
        self.pcfg = cfg.policies[index]
        self.name = self.pcfg.name
        self.run_dir = Path(run_dir) if run_dir else None
        self.options = spec.options
        self.label = spec.label
        seed = cfg.seed * 1009 + index + 7919 * spec.rank  # each rank samples its own stream
        torch.manual_seed(seed)
        self.task = build_task(cfg.task, run_seed=cfg.seed)
        self.device = spec.device
        self.ranks = RankGroup(spec.rank, spec.world, spec.rendezvous, self.device or "cpu",
                               timeout_s=cfg.step_timeout_s)
        self.policy = Policy(self.name, resolve_model_path(self.pcfg.model), self.options,
                             prompt_template=self.pcfg.prompt_template, system_prompt=self.pcfg.system_prompt,
                             seed=seed, device=self.device, peft=self.pcfg.peft, generation=self.pcfg.generation,
                             vllm_memory_fraction=spec.vllm_memory_fraction)
        self.ranks.broadcast_parameters(self.policy.model)  # a random adapter starts alike on every rank
        if self.pcfg.fsdp and self.ranks.active:  # before a sharing step adds its optimizers
            self.policy.shard()
        import_strategy_modules(cfg.sharing.modules)
        self.strategy = parse_strategy(cfg.sharing.strategy)
        self.settings = spec.sharing
        """Every step's settings (its ``sharing.<step>`` block, with this policy's overrides), by step
        name: the plan's instances, the ones the cost model priced."""
        for phase, lr in self.strategy.optimizer_phases(self.settings).items():
            self.policy.add_optimizer(phase, lr)
        if spec.micro_batch_tokens is not None:  # the plan's budget: auto resolved against the worker's memory
            self.policy.micro_batch_tokens = spec.micro_batch_tokens
        self.predicted_peak_bytes = spec.predicted_peak_bytes
        self.predicted_resident_bytes = spec.predicted_resident_bytes
        self.peers = self._load_peers()
        vocab = {self.policy.tokenizer_id: len(self.policy.tokenizer)}
        vocab.update({p.tokenizer_id: len(p.tokenizer) for p in self.peers.values()})
        self.limits = ExperienceLimits(reward_range=self._reward_range(), vocab_sizes=vocab,
                                       known_prompt_ids=frozenset(self.task.known_ids()))
        self.exchange = exchange if exchange is not None else open_exchange(spec.exchange, limits=self.limits)
        self._groups: dict[int, list[OwnGroup]] = {}
        self.params = self.policy.parameter_count()
        self._memo: dict[str, Any] = {}
        self.me = PeerView(self.name, self.policy.tokenizer, self.policy.tokenizer_id, frozenset(self.policy.eos_ids),
                           self.pcfg.prompt_template, self.pcfg.system_prompt)
        self.peer_names = frozenset(p.name for i, p in enumerate(cfg.policies) if i != index)

    # ------------------------------------------------------------------ setup helpers
    def _reward_range(self) -> tuple[float, float]:
        lo, hi = self.task.reward_range
        if self.task.reward_functions:  # extra reward functions may shift the range
            return (-float("inf"), float("inf"))
        return (lo, hi)

    def _load_peers(self) -> dict[str, PeerView]:
        """What this policy knows of each other policy of the run, keyed by name: its tokenizer,
        the ids it stops on and how it formats a prompt (for THL alignment of its rollouts)."""
        from transformers import AutoTokenizer

        out = {}
        for i, p in enumerate(self.cfg.policies):
            if i == self.index:
                continue
            path = resolve_model_path(p.model)
            tok = AutoTokenizer.from_pretrained(path)
            out[p.name] = PeerView(p.name, tok, tokenizer_fingerprint(tok), model_stop_ids(path, tok),
                                   p.prompt_template, p.system_prompt)
        return out

    def step_problems(self, step: int, round: int = 0, exclude: frozenset[str] = frozenset()) -> list[Problem]:
        """The step's prompts, every rank's (round 0 is shared by every policy; later rounds: dynamic
        sampling)."""
        return self.task.sample_train(step, self.cfg.prompts_per_step, round, exclude)

    def problems(self, step: int, round: int = 0, exclude: frozenset[str] = frozenset()) -> list[Problem]:
        """This worker's part of the step's prompts (all of them for a policy of one worker)."""
        return self.ranks.shard(self.step_problems(step, round, exclude))  # type: ignore[return-value]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> tuple[list[float], list[float]]:
        """(rewards, verifier scores) of completions, one per problem: the one scoring path of own
        samples, re-scored peer samples and peer successes (reward functions see the prompt as
        this policy formats it)."""
        return self.task.rewards(problems, [self.policy.format_prompt(p.question) for p in problems],
                                 completions)

    # ------------------------------------------------------------------ step parts
    def _sample_groups(self, probs: list[Problem]) -> tuple[list[OwnGroup], list[Any]]:
        g = self.options.num_generations
        if not probs:
            return [], []
        samples = self.policy.generate([p.question for p in probs], g)
        rewards, scores = self.score([probs[s.prompt_index] for s in samples], [s.text for s in samples])
        groups = []
        for i, p in enumerate(probs):
            sl = slice(i * g, (i + 1) * g)
            ss = samples[sl]
            groups.append(OwnGroup(p, ss[0].prompt_ids, [s.completion_ids for s in ss], [s.logprobs for s in ss],
                                   rewards[sl], scores[sl], [s.text for s in ss]))
        return groups, samples

    def _records(self, groups: list[OwnGroup], step: int) -> list[Any]:
        """The step's records to publish: every completion (its record id kept on its group), each
        group's outcome, and each distinct verified success."""
        records: list[Any] = []
        now = time.time()
        for grp in groups:
            p = grp.problem
            for j, (ids, lps, text, rw) in enumerate(zip(grp.completion_ids, grp.logprobs, grp.texts, grp.rewards,
                                                         strict=True)):
                records.append(Rollout(p.id, p.question, text, self.name, self.policy.tokenizer_id,
                                       ids, lps, rw, step, j, now))
                grp.record_ids.append(records[-1].record_id)
            records.append(GroupOutcome.from_rewards(p.id, self.name, grp.rewards, step, created_at=now))
            seen = set()
            for text, sc in zip(grp.texts, grp.scores, strict=True):
                if self.task.is_success(sc) and text not in seen:
                    seen.add(text)
                    records.append(VerifiedSuccess(p.id, text, self.name, f"{p.source}:verifier", sc, step, now))
        return records

    @_numerics
    def rollout(self, step: int) -> dict[str, float]:
        """Sample the group for each of this step's prompts, score it and publish it.

        With ``dynamic_sampling: resample``, further prompt batches are drawn until
        ``prompts_per_step`` groups have reward variance (or ``max_resample_rounds`` is spent).
        """
        t0 = time.perf_counter()
        opts = self.options
        self.exchange.advance(step)  # the exchange's clock: the window rows must fall in, and retention
        groups, samples = self._sample_groups(self.problems(step))
        first = list(groups)
        rounds = 0
        if opts.dynamic_sampling == "resample":  # the ranks decide together: each round is sharded too
            drawn = frozenset(p.id for p in self.step_problems(step))
            while rounds < opts.max_resample_rounds and \
                    self.ranks.sum([sum(g.informative for g in groups)])[0] < self.cfg.prompts_per_step:
                rounds += 1
                batch = self.step_problems(step, rounds, drawn)
                more, more_samples = self._sample_groups(self.ranks.shard(batch))  # type: ignore[arg-type]
                drawn |= {p.id for p in batch}
                groups += more
                samples += more_samples
        t_gen = time.perf_counter() - t0
        records = self._records(groups, step)
        self._groups[step] = groups
        fault_point("rollout")
        t1 = time.perf_counter()
        pub = self.exchange.publish(records)
        t_pub = time.perf_counter() - t1
        log_acknowledged(self.name, step, (r.record_id for r in records))
        fault_point("published")
        # reward and accuracy of the step's shared batch (round 0), comparable across settings
        first_scores = [sc for grp in first for sc in grp.scores]
        m = {
            "reward_mean": float(np.mean([r for grp in first for r in grp.rewards])),
            "train_acc": float(np.mean([self.task.is_success(sc) for sc in first_scores])),
            "gen_tokens": sum(len(s.completion_ids) for s in samples),
            "flops_sampling": 2.0 * self.params * sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
            "rollout_s": time.perf_counter() - t0,
            "generate_s": t_gen,
            "publish_s": t_pub,
            "published": pub.accepted,
            "informative_group_frac": float(np.mean([g.informative for g in groups])),
            **self.task.reward_stats.as_dict(),
        }
        if opts.dynamic_sampling == "resample":
            m["resample_rounds"] = rounds
        per_source: dict[str, list[float]] = {}
        for grp in first:
            per_source.setdefault(grp.problem.source, []).extend(grp.scores)
        for src, sc in per_source.items():
            m[f"train_acc/{src}"] = float(np.mean([self.task.is_success(s) for s in sc]))
        return m

    def _align_peer(self, r: Rollout, prompt_ids: Sequence[int]) -> PeerTrace:
        """THL: a peer's rollout in this policy's tokens after ``prompt_ids``, with the peer's side
        encoded in the peer's own prompt and its own stop ids (or why it cannot be used)."""
        peer = self.peers.get(r.source_policy)
        if peer is None or peer.tokenizer_id != r.source_tokenizer:
            return PeerTrace(refused="unknown_tokenizer")
        return peer_trace(r.completion, list(r.token_ids), list(r.logprobs), peer.tokenizer, self.policy.tokenizer,
                          prompt=list(prompt_ids), source_prompt=peer.format_prompt(r.prompt),
                          source_stop_ids=peer.stop_ids)

    def _encode_peer_text(self, prompt_ids: Sequence[int], text: str) -> list[int] | None:
        """A peer's verified text as this policy would emit it after ``prompt_ids`` (EOS last), or
        None when this policy's tokenizer cannot write it (it would not decode back to the text)."""
        ids = self.policy.encode_completion(prompt_ids, text, add_eos=False)
        if not represents(self.policy.tokenizer, ids, text):
            return None
        return ids + [self.policy.tokenizer.eos_token_id]

    def _source(self, step: int) -> StepSource:
        """What a strategy step's ``gather`` and ``serve`` hooks may ask for at ``step``."""
        return StepSource(step, self.name, self.peer_names, self.problems, self.exchange.query,
                          self.policy.encode_prompt, self.peers, self.me, self._score_texts, self.params,
                          tuple(self.task.source_names), self._memo)

    def _score_texts(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
                     ) -> list[list[float]]:
        """This policy's per-token log-probs of ``completions`` (no gradient), micro-batched."""
        budget = self.policy.micro_batch_tokens or 1 << 62
        out: list[list[float]] = []
        self.policy.model.eval()
        with torch.no_grad():
            i = 0
            while i < len(prompts):
                j, tokens = i, 0
                while j < len(prompts) and (j == i or tokens + len(prompts[j]) + len(completions[j]) <= budget):
                    tokens += len(prompts[j]) + len(completions[j])
                    j += 1
                lp = self.policy.logprobs([list(p) for p in prompts[i:j]],
                                          [list(c) or [self.policy.pad_id] for c in completions[i:j]], local=True)
                out += [lp[k, lp.shape[1] - len(c):].tolist() if c else [] for k, c in enumerate(completions[i:j])]
                i = j
        return out

    @_numerics
    def serve(self, step: int) -> dict[str, float]:
        """Work for the peers between the rollouts and the updates (the strategy's ``serve`` hooks:
        e.g. scores of the peers' samples) and publish it; the metrics (``flops_scoring``)."""
        t0 = time.perf_counter()
        records, m = serve_peers(self.strategy, self._source(step), self.settings)
        pub = self.exchange.publish(records) if records else None
        m["serve_s"] = time.perf_counter() - t0
        m["serve_published"] = float(pub.accepted if pub is not None else 0)
        m["flops_scoring"] = 2.0 * self.params * m.get("scored_tokens", 0.0)
        return m

    @_numerics
    def update(self, step: int) -> dict[str, float]:
        """Query peers' rows, build the strategy's batch and train on it."""
        t0 = time.perf_counter()
        groups = self._groups.pop(step)
        self.policy.set_learning_rate(learning_rate_at(self.options, step, self.cfg.steps))
        peers = PeerRows()
        t_q = 0.0
        untrusted_rows = 0
        if self.strategy.queries:
            tq = time.perf_counter()
            rows = self.exchange.query([g.problem.id for g in groups], kinds=sorted(self.strategy.queries),
                                       exclude_source=self.name, min_version=step - self.cfg.sharing.max_staleness)
            t_q = time.perf_counter() - tq
            # only the run's other policies are peers: rows under any other source name (a
            # foreign or buggy publisher on a shared exchange) are counted and ignored
            trusted = [r for r in rows if r.version <= step and r.source_policy in self.peer_names]
            untrusted_rows = sum(r.source_policy not in self.peer_names for r in rows)
            peers = PeerRows.from_records(trusted)
        gathered = gather_context(self.strategy, self._source(step), self.settings)
        ctx = ShareContext(groups, peers, self.options, self.score, self._encode_peer_text, self._align_peer,
                           gathered, world=self.ranks.world,
                           sum_over_ranks=self.ranks.sum if self.ranks.active else None)
        t1 = time.perf_counter()
        batch = build_batch(self.strategy, ctx, self.settings)
        t_share = time.perf_counter() - t1
        t2 = time.perf_counter()
        fault_point("update")
        gen = self.pcfg.generation
        sync0 = self.ranks.gradient_sync_s
        getattr(self.policy.engine, "sleep", lambda: None)()  # vLLM on a GPU frees its KV cache (sync wakes it)
        fresh_peak = reset_process_peak()  # this update's own peak, even with every policy in one process
        stats = train_on_batch(self.policy, batch, ranks=self.ranks,
                               is_cap=gen.importance_sampling_cap if gen.importance_sampling_correction else None)
        t_sync = self.policy.sync_engine()
        m = dict(batch.metrics)
        m.update(stats)
        m["sync_s"] = t_sync
        if self.ranks.active:  # merged: the largest (the rank that waited longest) and the smallest
            m["allreduce_s"] = m["allreduce_s_min"] = self.ranks.gradient_sync_s - sync0  # (~ the transfer)
        m["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if fresh_peak:
            m["update_rss_peak_mb"] = process_peak_bytes() / 2**20
        m["micro_batch_tokens"] = self.policy.micro_batch_tokens or 0
        if self.predicted_peak_bytes:
            m["mem_predicted_peak_mb"] = self.predicted_peak_bytes / 2**20
        if self.predicted_resident_bytes:
            m["mem_predicted_resident_mb"] = self.predicted_resident_bytes / 2**20
        m["worker_processes"] = 1  # summed over a policy's ranks (ranks.merge_metrics): its processes
        if self.policy.device.type == "cuda":
            m["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.policy.device) / 2**20
        m.update({"update_s": time.perf_counter() - t0, "train_s": time.perf_counter() - t2,
                  "query_s": t_q, "share_s": t_share, "peer_rows_untrusted": untrusted_rows,
                  "train_tokens": sum(len(r.completion_ids) for r in batch.rows),
                  "flops_update": update_flops(batch, self.params, self.options)})
        return m

    @_numerics
    def evaluate(self, n: int | None = None, split: str = "test") -> dict[str, float]:
        """Greedy accuracy on held-out problems of ``split`` (``test`` or ``val``; the same problems for
        every policy): ``<split>_acc`` and ``<split>_acc/<type>``. The ranks of a policy each answer
        their share of the problems and agree on the counts (every rank returns the same figures)."""
        probs: list[Problem] = self.ranks.shard(eval_problems(self.task, n or self.cfg.eval_size, split))  # type: ignore[assignment]
        samples = self.policy.generate([p.question for p in probs], greedy=True,
                                       batch_size=self.cfg.eval_batch_size) if probs else []
        ok = [self.task.is_success(self.task.verify(p, s.text)) for p, s in zip(probs, samples, strict=True)]
        sources = list(self.task.source_names)
        counts = [float(sum(ok)), float(len(ok))]
        for src in sources:
            sel = [o for p, o in zip(probs, ok, strict=True) if p.source == src]
            counts += [float(sum(sel)), float(len(sel))]
        counts = self.ranks.sum(counts)
        out: dict[str, float] = {f"{split}_acc": counts[0] / max(1.0, counts[1])}
        for j, src in enumerate(sources):
            right, total = counts[2 + 2 * j], counts[3 + 2 * j]
            if total:
                out[f"{split}_acc/{src}"] = right / total
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:  # type: ignore[override]
        """Write this policy's weights, optimizer and RNG states into ``directory``."""
        save_policy_state(directory, self.policy, {"reward_stats": dataclasses.asdict(self.task.reward_stats),
                                                   "micro_batch_tokens": self.policy.micro_batch_tokens},
                          rank=self.ranks.rank, world=self.ranks.world)

    def load(self, directory: str | Path) -> None:  # type: ignore[override]
        """Restore what :meth:`save` wrote (weights strictly: a missing key is an error)."""
        st = load_policy_state(directory, self.policy, rank=self.ranks.rank, world=self.ranks.world)
        self.policy.sync_engine()  # a separate sampler (vLLM) samples from the restored weights
        for k, v in st.get("reward_stats", {}).items():  # cumulative counters continue where they were
            setattr(self.task.reward_stats, k, int(v))
        self._resume_micro_batches(st.get("micro_batch_tokens"))

    def _resume_micro_batches(self, saved: int | None) -> None:
        """An ``auto`` budget continues as the interrupted run had it (the same micro-batches, so the
        same float rounding: an exact resume), unless this placement gives the worker less memory
        than that budget needs; then the plan's, and a warning."""
        if self.options.micro_batch_tokens != "auto" or not isinstance(saved, int):
            return
        now = self.policy.micro_batch_tokens
        if now is None or saved <= now:
            self.policy.micro_batch_tokens = saved
        elif saved != now:
            warnings.warn(f"policy {self.name!r}: resumed with micro_batch_tokens {now} (the plan's for this "
                          f"machine) instead of the run's {saved}, which no longer fits; the update's float "
                          "rounding differs from the uninterrupted run's", RuntimeWarning, stacklevel=2)

    def exchange_position(self) -> int:
        """The exchange's current position (recorded in checkpoints)."""
        return int(self.exchange.position())

    def exchange_discard_after(self, position: int) -> int:
        """Drop exchange rows written after ``position`` (rows of steps that will be redone)."""
        return int(self.exchange.discard_after(position))

    def info(self) -> dict[str, Any]:
        """What this worker runs: sizes, tokenizer, device, dtype, engine, process id."""
        return {"name": self.name, "params": self.policy.parameter_count(),
                "trainable_params": self.policy.trainable_parameter_count(),
                "tokenizer": self.policy.tokenizer_id, "model_type": self.policy.model.config.model_type,
                "vocab_size": len(self.policy.tokenizer), "device": str(self.policy.device),
                "dtype": self.policy.compute_dtype, "engine": self.pcfg.generation.engine,
                "lora": self.policy.lora, "pid": os.getpid(), "data": self.task.data_report(),
                "rank": self.ranks.rank, "ranks": self.ranks.world}

    def set_threads(self, n: int) -> int:
        """Change this worker's torch intra-op threads (MWRA re-plans); returns the count in force."""
        torch.set_num_threads(max(1, int(n)))
        return torch.get_num_threads()

    def close(self) -> None:
        """Shut the sampling engine down and close the exchange (best effort, never raises)."""
        for closer in (self.policy.close, self.exchange.close, self.ranks.close):
            try:
                closer()
            except Exception:  # noqa: BLE001, S110 - closing is best effort
                pass
