"""A policy worker: one policy's rollout, publish, peer query, THL, strategy and update.

The controller (:class:`~mutualrl.trainer.MutualTrainer`) only sends step numbers; a worker
samples the step's prompts itself (deterministic in seed and step, identical for every worker),
so the same worker runs in-process, in a subprocess or as a Ray actor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mutualrl.algorithms.sharing import OwnGroup, PeerRows, ShareContext, build_batch
from mutualrl.algorithms.update import train_on_batch
from mutualrl.config import RunConfig
from mutualrl.experience import ExperienceLimits, GroupOutcome, Rollout, VerifiedSuccess
from mutualrl.faults import fault_point, log_acknowledged
from mutualrl.policy import Policy, resolve_model_path
from mutualrl.tasks.base import Problem, Task


def build_task(cfg: RunConfig) -> Task:
    """The run's task from its config (the zoo preset or the listed datasets)."""
    from mutualrl.tasks import FileSource, GymSource, load_reward_function

    t = cfg.task
    if t.preset == "zoo":
        from mutualrl import zoo

        task = zoo.default_task(seed=t.seed, test_size=t.test_size, train_size=t.train_size)
        # the preset replaces only the datasets: extraction and extra rewards still apply
        task.answer_extraction = t.answer_extraction
        task.reward_functions = [load_reward_function(p) for p in t.reward_functions]
        task.reward_timeout_s = t.reward_timeout_s
        return task
    sources, weights = [], []
    for d in t.datasets:
        if d.name is not None:
            sources.append(GymSource(d.name, d.alias, d.config))
        else:
            sources.append(FileSource(d.path, d.alias, d.question_field, d.answer_field, d.test_fraction))
        weights.append(d.weight)
    return Task(sources, weights, test_size=t.test_size, train_size=t.train_size, seed=t.seed,
                answer_extraction=t.answer_extraction,
                reward_functions=[load_reward_function(p) for p in t.reward_functions],
                reward_timeout_s=t.reward_timeout_s)


def exchange_url(cfg: RunConfig, run_dir: Path | None) -> str:
    if cfg.exchange == "sqlite":
        if run_dir is None:
            return "memory://"
        return f"sqlite:///{Path(run_dir).resolve() / 'exchange.db'}"
    return cfg.exchange


class PolicyWorker:
    """Owns one policy and does its part of every step."""

    def __init__(self, cfg: RunConfig, index: int, run_dir: str | Path | None = None,
                 exchange: Any | None = None, threads: int | None = None) -> None:
        from mutualrl.exchange import open_exchange

        if threads:
            torch.set_num_threads(threads)
        _quiet_transformers()
        self.cfg = cfg
        self.index = index
        self.pcfg = cfg.policies[index]
        self.name = self.pcfg.name
        self.run_dir = Path(run_dir) if run_dir else None
        self.options = cfg.policy_grpo(index)
        seed = cfg.seed * 1009 + index
        torch.manual_seed(seed)
        self.task = build_task(cfg)
        self.policy = Policy(self.name, resolve_model_path(self.pcfg.model), self.options,
                             prompt_template=self.pcfg.prompt_template, system_prompt=self.pcfg.system_prompt,
                             seed=seed)
        self.peer_tokenizers = self._load_peer_tokenizers()
        vocab = {self.policy.tokenizer_id: len(self.policy.tokenizer)}
        vocab.update({tid: len(tok) for tid, tok in self.peer_tokenizers.items()})
        self.limits = ExperienceLimits(reward_range=self._reward_range(), vocab_sizes=vocab,
                                       known_prompt_ids=frozenset(self.task.known_ids()))
        self.exchange = exchange if exchange is not None else open_exchange(exchange_url(cfg, self.run_dir),
                                                                           limits=self.limits)
        self._groups: dict[int, list[OwnGroup]] = {}
        self.peer_names = frozenset(p.name for i, p in enumerate(cfg.policies) if i != index)
        self._prompt_cache: dict[str, list[int]] = {}
        self._align_cache: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ setup helpers
    def _reward_range(self) -> tuple[float, float]:
        lo, hi = self.task.reward_range
        if self.task.reward_functions:  # extra reward functions may shift the range
            return (-float("inf"), float("inf"))
        return (lo, hi)

    def _load_peer_tokenizers(self) -> dict[str, Any]:
        """Tokenizers of the other policies, keyed by tokenizer id (for THL alignment)."""
        from transformers import AutoTokenizer

        from mutualrl.policy import tokenizer_fingerprint

        out = {}
        for i, p in enumerate(self.cfg.policies):
            if i == self.index:
                continue
            tok = AutoTokenizer.from_pretrained(resolve_model_path(p.model))
            out[tokenizer_fingerprint(tok)] = tok
        return out

    def prompt_ids(self, problem: Problem) -> list[int]:
        ids = self._prompt_cache.get(problem.id)
        if ids is None:
            ids = self.policy.encode_prompt(problem.question)
            self._prompt_cache[problem.id] = ids
        return ids

    def problems(self, step: int) -> list[Problem]:
        return self.task.sample_train(step, self.cfg.prompts_per_step)

    # ------------------------------------------------------------------ step parts
    def rollout(self, step: int) -> dict[str, float]:
        """Sample the group for each of this step's prompts, score it and publish it."""
        t0 = time.perf_counter()
        probs = self.problems(step)
        g = self.options.num_generations
        samples = self.policy.generate([p.question for p in probs], g)
        t_gen = time.perf_counter() - t0
        rewards, scores = self.task.rewards([probs[s.prompt_index] for s in samples],
                                            [self.policy.format_prompt(probs[s.prompt_index].question)
                                             for s in samples], [s.text for s in samples])
        groups: list[OwnGroup] = []
        records: list[Any] = []
        now = time.time()
        for i, p in enumerate(probs):
            sl = slice(i * g, (i + 1) * g)
            ss = samples[sl]
            grp = OwnGroup(p, ss[0].prompt_ids, [s.completion_ids for s in ss], [s.logprobs for s in ss],
                           rewards[sl], scores[sl])
            groups.append(grp)
            for j, s in enumerate(ss):
                records.append(Rollout(p.id, p.question, s.text, self.name, self.policy.tokenizer_id,
                                       s.completion_ids, s.logprobs, rewards[i * g + j], step, j, now))
            records.append(GroupOutcome.from_rewards(p.id, self.name, rewards[sl], step, created_at=now))
            seen = set()
            for s, sc in zip(ss, scores[sl], strict=True):
                if self.task.is_success(sc) and s.text not in seen:
                    seen.add(s.text)
                    records.append(VerifiedSuccess(p.id, s.text, self.name, f"{p.source}:verifier", sc, step, now))
        self._groups[step] = groups
        fault_point("rollout")
        t1 = time.perf_counter()
        pub = self.exchange.publish(records)
        t_pub = time.perf_counter() - t1
        log_acknowledged(self.name, step, (r.record_id for r in records))
        fault_point("published")
        n_tok = sum(len(s.completion_ids) for s in samples)
        per_source: dict[str, list[float]] = {}
        for grp in groups:
            per_source.setdefault(grp.problem.source, []).extend(grp.scores)
        m = {
            "reward_mean": float(np.mean(rewards)),
            "train_acc": float(np.mean([self.task.is_success(s) for s in scores])),
            "gen_tokens": n_tok,
            "rollout_s": time.perf_counter() - t0,
            "generate_s": t_gen,
            "publish_s": t_pub,
            "published": pub.accepted,
            **self.task.reward_stats.as_dict(),
        }
        for src, sc in per_source.items():
            m[f"train_acc/{src}"] = float(np.mean([self.task.is_success(s) for s in sc]))
        return m

    def _align_peer(self, r: Rollout):
        """THL: peer rollout -> (learner completion ids, chunks in learner tokens, residual)."""
        from mutualrl.thl.peer import peer_trace

        src_tok = self.peer_tokenizers.get(r.source_tokenizer)
        if src_tok is None:
            return None
        return peer_trace(r.completion, list(r.token_ids), list(r.logprobs), src_tok, self.policy.tokenizer)

    def update(self, step: int) -> dict[str, float]:
        """Query peers' rows, build the strategy's batch and train on it."""
        t0 = time.perf_counter()
        groups = self._groups.pop(step)
        spec = self.cfg.sharing.strategy
        peers = PeerRows()
        t_q = 0.0
        untrusted_rows = 0
        if spec != "independent":
            kinds = []
            if "prp" in spec:
                kinds.append("rollout")
            if "xgrpo" in spec:
                kinds.append("group_outcome")
            if "sgt" in spec:
                kinds.append("verified_success")
            tq = time.perf_counter()
            rows = self.exchange.query([g.problem.id for g in groups], kinds=kinds, exclude_source=self.name,
                                       min_version=step - self.cfg.sharing.max_staleness)
            t_q = time.perf_counter() - tq
            # only the run's other policies are peers: rows under any other source name (a
            # foreign or buggy publisher on a shared exchange) are counted and ignored
            trusted = [r for r in rows if r.version <= step and r.source_policy in self.peer_names]
            untrusted_rows = sum(r.source_policy not in self.peer_names for r in rows)
            peers = PeerRows.from_records(trusted)
        ctx = ShareContext(groups, peers, self.task, self.options, self.cfg.sharing,
                           lambda text, eos: self.policy.encode_completion(text, eos), self._align_peer)
        t1 = time.perf_counter()
        batch = build_batch(spec, ctx)
        t_share = time.perf_counter() - t1
        t2 = time.perf_counter()
        fault_point("update")
        stats = train_on_batch(self.policy, batch, prp_ratio_clip=self.cfg.sharing.prp_ratio_clip)
        m = dict(batch.metrics)
        m.update(stats)
        m.update({"update_s": time.perf_counter() - t0, "train_s": time.perf_counter() - t2,
                  "query_s": t_q, "share_s": t_share, "peer_rows_untrusted": untrusted_rows,
                  "train_tokens": sum(len(r.completion_ids) for r in batch.rows)})
        return m

    def evaluate(self, n: int | None = None) -> dict[str, float]:
        """Greedy accuracy on the held-out test problems (the same for every policy)."""
        probs = eval_problems(self.task, n or self.cfg.eval_size)
        out: dict[str, float] = {}
        samples = self.policy.generate([p.question for p in probs], greedy=True,
                                       batch_size=self.cfg.eval_batch_size)
        ok = [self.task.is_success(self.task.verify(p, s.text)) for p, s in zip(probs, samples, strict=True)]
        out["test_acc"] = float(np.mean(ok))
        for src in self.task.source_names:
            sel = [o for p, o in zip(probs, ok, strict=True) if p.source == src]
            if sel:
                out[f"test_acc/{src}"] = float(np.mean(sel))
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:
        """Write this policy's weights, optimizer and RNG states into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().clone() for k, v in self.policy.model.state_dict().items()}
        save_file(_dedupe_shared(state), str(d / "model.safetensors"))
        torch.save(self.policy.optimizer.state_dict(), d / "optimizer.pt")
        torch.save({"generator": self.policy.generator.get_state(), "torch": torch.get_rng_state()},
                   d / "rng.pt")
        (d / "state.json").write_text(json.dumps({
            "version": self.policy.version, "python_random": _py_random_state(),
            "numpy_random": _np_random_state(),
            "reward_stats": dataclasses.asdict(self.task.reward_stats)}))

    def load(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        d = Path(directory)
        sd = load_file(str(d / "model.safetensors"))
        self.policy.model.load_state_dict(sd, strict=False)
        self.policy.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        rng = torch.load(d / "rng.pt", weights_only=True)
        self.policy.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        st = json.loads((d / "state.json").read_text())
        self.policy.version = int(st["version"])
        _set_py_random_state(st["python_random"])
        _set_np_random_state(st["numpy_random"])
        for k, v in st.get("reward_stats", {}).items():  # cumulative counters continue where they were
            setattr(self.task.reward_stats, k, int(v))

    def exchange_position(self) -> int:
        """The exchange's current position (recorded in checkpoints)."""
        return int(self.exchange.position())

    def exchange_discard_after(self, position: int) -> int:
        """Drop exchange rows written after ``position`` (rows of steps that will be redone)."""
        return int(self.exchange.discard_after(position))

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.policy.parameter_count(),
                "tokenizer": self.policy.tokenizer_id, "model_type": self.policy.model.config.model_type,
                "vocab_size": len(self.policy.tokenizer), "pid": os.getpid()}

    def set_threads(self, n: int) -> int:
        """Change this worker's torch intra-op threads (MWRA re-plans); returns the count in force."""
        torch.set_num_threads(max(1, int(n)))
        return torch.get_num_threads()

    def close(self) -> None:
        try:
            self.exchange.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


def _quiet_transformers() -> None:
    """No per-load progress bars or info logs from transformers inside training."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def eval_problems(task: Task, n: int) -> list[Problem]:
    """The first test problems of each source in proportion to its weight (n in total)."""
    out: list[Problem] = []
    for src, w in zip(task.source_names, task.weights, strict=True):
        out.extend(task.test[src][: max(1, round(n * w))])
    return out


def _dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): keep one copy each."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in state.items():
        key = v.data_ptr()
        if key in seen and v.numel() > 0:
            continue
        seen[key] = k
        out[k] = v
    return out


def _py_random_state() -> list:
    s = random.getstate()
    return [s[0], list(s[1]), s[2]]


def _set_py_random_state(s: list) -> None:
    random.setstate((s[0], tuple(s[1]), s[2]))


def _np_random_state() -> dict:
    st = np.random.get_state()
    return {"keys": st[1].tolist(), "pos": int(st[2]), "has_gauss": int(st[3]), "cached": float(st[4])}


def _set_np_random_state(s: dict) -> None:
    np.random.set_state(("MT19937", np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"]))

