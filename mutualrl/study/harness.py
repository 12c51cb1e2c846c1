"""The protocol a reviewer accepts, as a library: choices on validation, the test split read once,
compute-matched baselines, seeds that vary the prompts, paired intervals, committed per-run records.

A study is a sequence of *tuning rounds* and one *final round*:

- a tuning round (:meth:`Study.tune`) runs each candidate of a family (``independent`` at several
  learning rates, say) on the tuning seeds and keeps the candidate with the best mean final
  **validation** accuracy (the average over the policies); later rounds build on the choices of
  earlier ones (the sharing arms take the tuned GRPO settings);
- the final round (:meth:`Study.run`) runs every chosen arm on every final seed. A run's seed is its
  prompt stream's (``task.prompt_seed`` follows the run's ``seed``) and its sampling's; its test
  split is read once, at its end.

Every run's compact record (:mod:`mutualrl.study.records`) goes to ``<results>/<name>_runs/``; the
study's JSON (:meth:`Study.write`) is aggregated from those files alone
(:func:`mutualrl.study.aggregate.aggregate`), so every figure can be traced and recomputed.

Runs go up to ``jobs`` at a time, as many as their memory prices let fit (:meth:`Study.run`), each in
its own process (``python -m mutualrl.study.one``; torch threads = cores / jobs); ``reuse`` keeps
finished runs whose config is unchanged (a run directory's summary, or a committed record when the run
directories are gone) and resumes interrupted ones.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutualrl.allocation.memory import available_bytes, gib, machine_bytes, process_tree_rss
from mutualrl.run.progress import Progress
from mutualrl.study.aggregate import (
    StudyError,
    aggregate,
    check_paired_builds,
    final_val,
    print_table,
    runs_dir,
)
from mutualrl.study.provenance import git_rev, machine, write_json
from mutualrl.study.records import (
    compact_record,
    deep_merge,
    load_records,
    log_path,
    run_name,
    spec_path,
    write_record,
)
from mutualrl.study.reuse import RecordFinder, same_config
from mutualrl.study.run_price import RunPrice

ROLES = ("baseline", "sharing", "matched_sharing", "efficiency", "half_baseline")
"""An arm's role: ``baseline`` (single model), ``sharing``, ``matched_sharing`` (a sharing arm held to
each policy's compute in the strongest baseline: reported against it, not a candidate for the best
arm), ``efficiency`` (sharing at a smaller own budget) or ``half_baseline`` (single model at that
budget)."""


MEMORY_FLOOR = 0.08
"""The share of the machine's RAM a study keeps free of its runs: another run starts only where the
runs' memory prices leave it (:meth:`Study._room_for_another`), and while several runs go at once,
below it available the study stops its youngest run (it resumes later, one fewer at once) before the
kernel's OOM killer picks one. A sudden jump passes it before a poll sees it: two real-model runs of
``benchmarks/mutual_real_small.py`` hold ~8 GiB each until Gemma-3's first update (its few successes can
delay it past the middle of a run) allocates its gradients and optimizer state, ~12 GiB after: two
such jumps pass a 24 GB machine, and the OOM killer's SIGKILL is then what the study answers."""


class RunFailed(RuntimeError):
    """A run of the study exited with an error; the message names the arm, the seed and its log."""


@dataclass
class Arm:
    """One arm of a study: a name, its family (the tuning round it belongs to), its role (one of
    :data:`ROLES`) and its overrides of the study's base run config."""

    name: str
    family: str
    role: str
    overrides: dict[str, Any] = field(default_factory=dict)
    seed_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Further overrides of one seed's run, merged last (a compute-matched control's per-policy token
    budget, read from the sharing arm's run of the same seed)."""


@dataclass
class _Running:
    arm: Arm
    seed: int
    run_dir: Path
    proc: subprocess.Popen[bytes]
    one_process: bool = True
    """Its policies train in the run's own process (the sequential scheduler): stopping that process
    stops the run, and a SIGKILL it gets is the OOM killer's choice of it (under the local scheduler
    the OOM killer takes a worker and the run fails as any other)."""
    price: RunPrice | None = None
    """Its memory price, read from its metrics as they land (None: not read)."""


@dataclass
class Study:
    """Runs arms on seeds under one base config; records and aggregates them."""

    name: str
    base_config: Callable[[int], dict[str, Any]]
    """seed -> the run config every arm starts from."""
    out: Path
    """Where the run directories go (``<out>/<arm>-seed<N>/``)."""
    results: Path | None = None
    """Where the records (``<name>_runs/``), the JSON (``<name>.json``) and the report
    (``<name>_report/``) go; None: ``out``."""
    jobs: int = 1
    reuse: bool = False
    parallel: int | None = None
    """Runs at once (default ``jobs``): fewer than ``jobs`` keeps the runs' configs (threads = cores /
    jobs) where memory does not hold ``jobs`` of them (two real-model runs peak at ~24 GB together)."""
    final_seeds: list[int] | None = None
    """The final round's seeds, when they are declared (fresh seeds apart from the tuning seeds): the
    headline is aggregated over these alone, so a tuning run on another seed of a chosen arm stays out
    of it. None: the longest seed list an arm holds (the tuning seed is then one of the final ones)."""
    reuse_from: list[str] = field(default_factory=list)
    """Other studies (in ``results``) whose records this one may take, copied into its own ``_runs/``
    (with ``reuse``; marked ``reused_from``): a later stage of a study reuses the earlier stage's runs
    of the same config instead of training them again."""
    reuse_from_seeds: list[int] | None = None
    """The seeds whose records ``reuse_from`` may give (a later stage takes the earlier one's tuning
    runs, never its final runs, whose test split was read); None: any."""
    records_suffice: bool = True
    """With ``reuse``, a committed record stands for a run whose directory is gone; False for a study
    that reads its run directories (their metrics or exchange beyond the record): such a run is
    trained again."""
    keep_checkpoints: bool = False
    """Keep a finished run's checkpoints (default: removed once its record is written: the record is
    all the study reads, and two checkpoints of the real-model pair take ~10 GB a run)."""
    target: float | None = None
    """The plan's target for the peers' share, in points: the JSON's ``target`` says whether the
    headline met it (:func:`~mutualrl.study.evidence.target_verdict`); None: no verdict."""
    progress: Progress | None = None
    """Counts finished (or reused) runs and shows what runs; None: one line per event on stderr."""
    arms: dict[str, Arm] = field(default_factory=dict)
    tuning: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    load_start: float = field(default_factory=lambda: os.getloadavg()[0])
    _trained: set[Path] = field(default_factory=set)
    """Run directories this study process trained (a later round reuses them even without ``reuse``)."""
    _counted: set[Path] = field(default_factory=set)
    """Run directories counted on the progress display (trained or reused: once each)."""
    _memory_cap: int | None = None
    """Runs at once memory allows, once a run was stopped or killed for it (:meth:`run`); None: no cap."""
    _killed: set[Path] = field(default_factory=set)
    """Run directories whose run a SIGKILL ended once beside others (run again; a second time fails)."""
    _prices: dict[str, int] = field(default_factory=dict)
    """The largest memory price each arm's runs reached in this study process (bytes)."""
    _held_at: tuple[str, int] | None = None
    """The waiting arm and the runs going when the study last said memory held it back (said once)."""
    _finder: RecordFinder | None = None

    @property
    def results_dir(self) -> Path:
        """Where the records, the JSON and the report go."""
        return Path(self.results if self.results is not None else self.out)

    @property
    def runs_dir(self) -> Path:
        """The study's records: ``<results>/<name>_runs``."""
        return runs_dir(self.results_dir, self.name)

    @property
    def finder(self) -> RecordFinder:
        """What finds a committed record of a run (this study's, or ``reuse_from``'s)."""
        if self._finder is None:
            self._finder = RecordFinder(self.results_dir, self.name, self.reuse_from, self.reuse_from_seeds, self.say)
        return self._finder

    def config(self, arm: Arm, seed: int) -> dict[str, Any]:
        """The run config of ``arm`` on ``seed``: the base config with the arm's overrides; the prompt
        stream follows the run's seed."""
        cfg = deep_merge(deep_merge(self.base_config(seed), arm.overrides), arm.seed_overrides.get(seed, {}))
        cfg["seed"] = seed
        cfg.setdefault("task", {}).pop("prompt_seed", None)
        return cfg

    def say(self, message: str) -> None:
        """Show what the study does: on the progress display when there is one, else on stderr."""
        if self.progress is not None and self.progress.enabled:
            self.progress.update(self.progress.done, info=message)
        else:
            print(f"[{self.name}] {message}", file=sys.stderr, flush=True)

    def _advance(self, run_dir: Path, message: str) -> None:
        """One run of the study is done (trained, or reused): counted once per study process."""
        if run_dir in self._counted:
            return
        self._counted.add(run_dir)
        if self.progress is not None:
            self.progress.update(self.progress.done + 1, info=message)
        else:
            self.say(message)

    # ------------------------------------------------------------------ running
    def _prepare(self, arm: Arm, seed: int) -> tuple[Path, bool] | None:
        """Record a run that needs no training (None), or write its spec and say whether it resumes."""
        from mutualrl.run.checkpoint import latest_checkpoint

        self.arms.setdefault(arm.name, arm)
        d = self.out / run_name(arm.name, seed)
        cfg = self.config(arm, seed)
        if (self.reuse or d in self._trained) and self._finished(d, cfg):  # trained already, record kept fresh
            self._record(d)
            self._advance(d, f"{arm.name} seed {seed} reused")
            return None
        if self.reuse and self.records_suffice and self.finder.recorded(arm.name, seed, cfg):  # kept as it is
            self._advance(d, f"{arm.name} seed {seed} recorded before")
            return None
        resume = self.reuse and d.is_dir() and self._same_spec(d, cfg) and latest_checkpoint(d) is not None
        if d.exists() and not resume:
            shutil.rmtree(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        spec_path(d).write_text(json.dumps({"arm": arm.name, "family": arm.family, "role": arm.role, "seed": seed,
                                            "overrides": arm.overrides, "config": cfg, "git_rev": git_rev()}))
        return d, resume

    def run(self, pairs: Iterable[tuple[Arm, int]]) -> None:
        """Train every (arm, seed) not yet recorded, ``jobs`` at a time; record each compactly.

        Memory: while several runs go at once, a machine left with less than :data:`MEMORY_FLOOR` of
        its RAM available stops the youngest run before the kernel's OOM killer picks one, and a run
        killed by a signal the OOM killer sends (SIGKILL) while others ran beside it is taken as one it
        picked (once a run; runs whose policies train in this run's process: the sequential scheduler,
        the default); either way the run goes back to the queue (it resumes from its last checkpoint,
        or starts afresh without one) and the study runs one fewer at once from then on, saying so. A
        run that fails alone, or is killed a second time, stops the study.

        Before that, a run beyond the first starts only once the runs going have priced their memory
        (their first step: MWRA's predicted peak, or the measured one where larger;
        :mod:`mutualrl.study.run_price`) and the next fits beside them, priced at what its arm's runs
        reached (or the largest price seen), with :data:`MEMORY_FLOOR` of the RAM left over; otherwise
        it waits for one to end (:meth:`_room_for_another`). Two real-model runs priced at 14 GiB never
        start together on a 24 GB machine, whatever ``jobs`` says."""
        from mutualrl.run.checkpoint import latest_checkpoint

        queue: deque[tuple[Arm, int, Path, bool]] = deque()
        for arm, seed in pairs:
            prepared = self._prepare(arm, seed)
            if prepared is not None:
                queue.append((arm, seed, *prepared))
        threads = self._threads()
        running: list[_Running] = []
        while queue or running:
            if queue and len(running) < self._at_once() and self._room_for_another(running, queue[0][0]):
                arm, seed, d, resume = queue.popleft()
                running.append(self._launch(arm, seed, d, resume, threads))
                continue
            running, again = self._reap(running)
            stopped = self._guard_memory(running)
            if stopped is not None:
                running.remove(stopped)
                again.append(stopped)
            for r in reversed(again):  # first in the queue: they had started before the waiting ones
                resume = latest_checkpoint(r.run_dir) is not None
                if resume or self._prepare(r.arm, r.seed) is not None:  # no checkpoint yet: afresh
                    queue.appendleft((r.arm, r.seed, r.run_dir, resume))
            if running and not again:
                time.sleep(1)

    def _at_once(self) -> int:
        """Runs at once: ``parallel`` (default ``jobs``; never more than ``jobs``, which would
        oversubscribe the cores), fewer once memory has stopped a run (:meth:`run`)."""
        at_once = max(1, min(self.parallel or self.jobs, self.jobs))
        return at_once if self._memory_cap is None else max(1, min(at_once, self._memory_cap))

    def _threads(self) -> int:
        """Each run's torch threads: the cores shared over ``jobs``."""
        return max(1, (os.cpu_count() or 1) // max(1, self.jobs))

    def _saw_price(self, arm: Arm, price: int) -> None:
        """Keep the largest memory price ``arm``'s runs reached (what its next run is priced at)."""
        self._prices[arm.name] = max(self._prices.get(arm.name, 0), price)

    def _room_for_another(self, running: list[_Running], arm: Arm) -> bool:
        """Whether a run of ``arm`` fits in memory beside ``running``. Each run going is priced
        (:class:`RunPrice`); the next at the largest price its arm's runs reached in this study, or,
        before any has, the largest any run reached. Together they must stay under ``1 - MEMORY_FLOOR``
        of the machine's RAM, and its price must be available now beside that floor once the runs going
        have grown to their prices (other processes count). False while a run going has not priced
        itself yet (its first step has not landed)."""
        if not running:
            return True
        prices = []
        for r in running:
            p = r.price.bytes() if r.price is not None else 0
            if p is None:
                return False
            self._saw_price(r.arm, p)
            prices.append(p)
        nxt = self._prices.get(arm.name, max(self._prices.values(), default=0))
        total, have = machine_bytes(), available_bytes()
        need = sum(prices) + nxt
        # what the runs going will still take before their peaks: their prices less what they hold now
        pids = [getattr(r.proc, "pid", None) for r in running]
        held = [(process_tree_rss(pid) if isinstance(pid, int) else None) or 0 for pid in pids]
        growth = sum(max(0, p - h) for p, h in zip(prices, held))
        short_now = have is not None and have - growth - nxt < MEMORY_FLOOR * total
        if need <= (1 - MEMORY_FLOOR) * total and not short_now:
            return True
        if self._held_at != (arm.name, len(running)):
            self._held_at = (arm.name, len(running))
            why = (f"{gib(have)} available now" if short_now and need <= (1 - MEMORY_FLOOR) * total else
                   f"{len(running) + 1} runs at once would need {gib(need)} of {gib(total)}")
            self.say(f"memory: {arm.name} waits for one of the {len(running)} run(s) going to end: priced at "
                     f"{gib(nxt)} (MWRA's predicted peak, or the measured one where larger), {why}; each run "
                     f"keeps the {self._threads()} torch thread(s) of "
                     f"{self.jobs} jobs (a lower --jobs gives a run more cores)")
        return False

    def _launch(self, arm: Arm, seed: int, d: Path, resume: bool, threads: int) -> _Running:
        cmd = [sys.executable, "-m", "mutualrl.study.one", str(d), "--parent", str(os.getpid())] + (
            ["--resume"] if resume else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.say(f"{arm.name} seed {seed}{' (resumed)' if resume else ''} -> {d}")
        one_process = self.config(arm, seed).get("scheduler", "sequential") == "sequential"
        with log_path(d).open("ab") as log:  # the child holds its own descriptor for its whole life
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        return _Running(arm, seed, d, proc, one_process, RunPrice(d, one_process))

    def _fewer_at_once(self, running: int, why: str) -> None:
        self._memory_cap = max(1, min(self._memory_cap or running, running) - 1)
        self.say(f"{why}: it runs again (from its last checkpoint where it has one); at most {self._memory_cap} "
                 f"run(s) at once from now on, with the torch threads they started with (--parallel "
                 f"{self._memory_cap} sets this from the start)")

    def _guard_memory(self, running: list[_Running]) -> _Running | None:
        """The youngest of several runs, stopped, when the machine has less than :data:`MEMORY_FLOOR` of
        its RAM available; None otherwise (one run alone is never stopped: nothing else to give way; nor
        one that has just ended, which :meth:`_reap` records or reports; nor a run whose policies train in
        worker processes, which stopping its process would orphan)."""
        if len(running) < 2:
            return None
        have, total = available_bytes(), machine_bytes()
        if have is None or have >= MEMORY_FLOOR * total:
            return None
        young = next((r for r in reversed(running) if r.one_process), None)
        if young is None or young.proc.poll() is not None:
            return None
        young.proc.terminate()
        try:
            code = young.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            young.proc.kill()
            code = young.proc.wait()
        if code not in (-signal.SIGTERM, -signal.SIGKILL):  # it ended on its own first: _reap's to judge
            return None
        self._fewer_at_once(len(running), f"memory: {gib(have)} of {gib(total)} available with {len(running)} runs "
                            f"at once; {young.arm.name} seed {young.seed} stopped before the OOM killer picks one")
        return young

    def _reap(self, running: list[_Running]) -> tuple[list[_Running], list[_Running]]:
        """Record every run that finished (at once, so that a study stopped later keeps it); stop the
        study at the first failed run, terminating the others (a rerun would race them). Returns the
        runs still going and those to run again: killed by SIGKILL (the OOM killer's signal) while
        others ran beside them."""
        left, again = [], []
        for r in running:
            code = r.proc.poll()
            if code is None:
                left.append(r)
            elif code == -signal.SIGKILL and r.one_process and len(running) > 1 and r.run_dir not in self._killed:
                self._killed.add(r.run_dir)  # once: a run killed again is a failure
                again.append(r)
                self._fewer_at_once(len(running), f"{r.arm.name} seed {r.seed} was killed (SIGKILL, the OOM "
                                    f"killer's signal) with {len(running)} runs at once")
            elif code != 0:
                for other in running:
                    if other.proc.poll() is None:
                        other.proc.terminate()
                        other.proc.wait()
                raise RunFailed(f"run {r.arm.name} seed {r.seed} failed (exit {code}); its log: "
                                f"{log_path(r.run_dir)}")
            else:
                price = r.price.bytes() if r.price is not None else None
                if price is not None:  # what a later run of its arm is priced at
                    self._saw_price(r.arm, price)
                self._record(r.run_dir)
                self._trained.add(r.run_dir)
                if not self.keep_checkpoints:  # the record is what the study reads; a real model's are GBs
                    shutil.rmtree(r.run_dir / "checkpoints", ignore_errors=True)
                self._advance(r.run_dir, f"{r.arm.name} seed {r.seed} recorded")
        return left, again

    def _same_spec(self, d: Path, cfg: dict[str, Any]) -> bool:
        try:
            return same_config(json.loads(spec_path(d).read_text())["config"], cfg, ignore_threads=False)
        except (OSError, ValueError, KeyError):
            return False

    def _finished(self, d: Path, cfg: dict[str, Any]) -> bool:
        return (d / "summary.json").is_file() and self._same_spec(d, cfg)

    def _record(self, d: Path) -> None:
        write_record(self.runs_dir, compact_record(d, json.loads(spec_path(d).read_text())))

    # ------------------------------------------------------------------ protocol
    def records(self, arm: Arm, seeds: Sequence[int]) -> list[dict[str, Any]]:
        """The records of ``arm``'s runs on ``seeds``."""
        return [r for r in load_records(self.runs_dir) if r["arm"] == arm.name and r["seed"] in seeds]

    def records_matching(self, prefix: str, seeds: Sequence[int]) -> list[dict[str, Any]]:
        """The records on ``seeds`` of every arm whose name starts with ``prefix`` (committed runs of
        arms that are no longer candidates included)."""
        return [r for r in load_records(self.runs_dir) if str(r["arm"]).startswith(prefix) and r["seed"] in seeds]

    def tune(self, family: str, candidates: Sequence[Arm], seeds: Sequence[int]) -> Arm:
        """Run ``candidates`` on ``seeds``; the one with the best mean final validation accuracy."""
        self.run((a, s) for a in candidates for s in seeds)
        runs = [r for a in candidates for r in self.records(a, seeds)]
        check_paired_builds(runs)
        scores = {}
        for a in candidates:
            vals = [final_val(r) for r in runs if r["arm"] == a.name]
            if not vals:
                raise StudyError(f"{family}: candidate {a.name} has no record on seeds {list(seeds)}")
            scores[a.name] = {"val_final": vals, "mean": statistics.fmean(vals), "overrides": a.overrides}
        chosen = max(candidates, key=lambda a: scores[a.name]["mean"])
        self.tuning[family] = {"seeds": list(seeds), "candidates": scores, "chosen": chosen.name,
                               "rule": "highest mean final validation accuracy (average over the policies)"}
        self.say(f"{family}: chose {chosen.name} (validation "
                 + ", ".join(f"{n} {100 * v['mean']:.1f}" for n, v in scores.items()) + ")")
        return chosen

    def per_step_by_policy(self, arm: Arm, seeds: Sequence[int], key: str) -> dict[str, float]:
        """The mean of step metric ``key`` of ``arm`` per step, for each policy (from its records)."""
        runs = self.records(arm, seeds)
        return {p: statistics.fmean(s.get(key, 0) for r in runs for s in r["steps"] if s["policy"] == p)
                for p in runs[0]["policies"]}

    def policy_budget(self, arm: Arm, seed: int, key: str = "train_tokens") -> dict[str, int]:
        """Per policy, the mean of step metric ``key`` over ``arm``'s run on ``seed`` (its record), rounded:
        the per-step budget a control matched on that run takes (:meth:`matched_overrides`)."""
        return {p: round(v) for p, v in self.per_step_by_policy(arm, [seed], key).items()}

    def policy_schedule(self, arm: Arm, seed: int, key: str = "train_tokens") -> dict[str, list[int]]:
        """Per policy, step metric ``key`` of ``arm``'s run on ``seed`` step by step (its record, in step
        order): the per-step budgets a control matched on that run step by step takes
        (``sharing.self_imitate.match_schedule``, :meth:`matched_overrides`)."""
        runs = self.records(arm, [seed])
        if len(runs) != 1:
            raise StudyError(f"{arm.name} on seed {seed}: {len(runs)} records, one needed for a schedule")
        run = runs[0]
        out: dict[str, list[int]] = {}
        for p in run["policies"]:
            by_step = {int(s["step"]): s for s in run["steps"] if s["policy"] == p}
            if sorted(by_step) != list(range(len(by_step))) or len(by_step) != sum(
                    1 for s in run["steps"] if s["policy"] == p):
                raise StudyError(f"{arm.name} on seed {seed}: {p}'s steps are not 0..n-1 once each (a torn or "
                                 "duplicated metrics row); its schedule would shift: run it again")
            out[p] = [round(float(by_step[t].get(key, 0))) for t in range(len(by_step))]
        return out

    def matched_overrides(self, seed: int, step: str, budget: Mapping[str, int],
                          generations: Mapping[str, int] | None = None,
                          schedule: Mapping[str, list[int]] | None = None) -> dict[str, Any]:
        """Overrides giving each policy of the base config its own ``sharing.<step>.match_tokens`` from
        ``budget`` (policy name -> tokens a step): per-policy overrides, merged into the policies list. A
        budget under one token (a policy that trained nothing in the run matched) gives 1, since
        ``match_tokens`` 0 means no limit: its control adds at most one row a step. ``generations``
        (policy name -> samples a prompt, :meth:`scoring_samples`) sets those policies'
        ``grpo.num_generations``; ``schedule`` (policy name -> tokens step by step,
        :meth:`policy_schedule`) their ``sharing.<step>.match_schedule``."""
        pols = [dict(p) for p in self.base_config(seed)["policies"]]
        missing = [p["name"] for p in pols if p["name"] not in budget]
        if missing:
            raise StudyError(f"no token budget for {', '.join(missing)} (budgets for {', '.join(budget)})")
        for p in pols:
            block: dict[str, Any] = {"match_tokens": max(1, int(budget[p["name"]]))}
            if schedule and p["name"] in schedule:
                block["match_schedule"] = [int(v) for v in schedule[p["name"]]]
            p["sharing"] = deep_merge(p.get("sharing", {}), {step: block})
            if generations and p["name"] in generations:
                p["grpo"] = deep_merge(p.get("grpo", {}), {"num_generations": int(generations[p["name"]])})
        return {"policies": pols}

    def scoring_samples(self, arm: Arm, seed: int, generations: int) -> dict[str, int]:
        """The policies whose control must sample more to spend what they spent in ``arm``'s run on
        ``seed`` sampling *and* scoring its peers' samples (``distill``'s serve phase), with their samples
        a prompt: ``generations`` x (1 + scoring FLOPs / sampling FLOPs), rounded. A policy that scored
        nothing (or by less than half a sample's worth) is left out: it keeps ``generations``."""
        scoring = self.per_step_by_policy(arm, [seed], "flops_scoring")
        sampling = self.per_step_by_policy(arm, [seed], "flops_sampling")
        out = {p: round(generations * (1 + scoring[p] / sampling[p])) for p in sampling if sampling[p] > 0}
        return {p: n for p, n in out.items() if n != generations}

    def per_step(self, arm: Arm, seeds: Sequence[int], key: str) -> float:
        """The mean of step metric ``key`` of ``arm`` per policy and step (from its records)."""
        return statistics.fmean(s.get(key, 0) for r in self.records(arm, seeds) for s in r["steps"])

    def write(self, extra: Mapping[str, Any] | None = None, *, report: bool = True,
              table: bool = True) -> dict[str, Any]:
        """Aggregate the records of this study's arms into ``<results>/<name>.json`` and (``report``,
        when the run directories are here) the report with its figure in ``<results>/<name>_report/``:
        with declared final seeds, of those seeds' runs alone (as the JSON)."""
        records = [r for r in load_records(self.runs_dir) if r["arm"] in self.arms  # a chosen arm's tuning run is
                   and (not self.final_seeds or r["seed"] in self.final_seeds)]  # not in the report
        threads = sorted({r["config"].get("threads") or 0 for r in records})
        if len(threads) > 1:
            self.notes.append(f"Runs trained on {' or '.join(map(str, threads))} torch threads (records reused "
                              "across a change of threads, which sets the speed, not the training).")
        result = aggregate(self.results_dir, self.name, list(self.arms), self.final_seeds, self.target)
        mach = machine()
        mach["load_avg"] = {"start": self.load_start, "end": os.getloadavg()[0]}
        result.update({"tuning": self.tuning, "notes": self.notes, "machine": mach, "jobs": self.jobs,
                       **({"declared_final_seeds": self.final_seeds} if self.final_seeds else {}),
                       "wall_s": time.perf_counter() - self.t0, **(extra or {})})
        write_json(self.results_dir / f"{self.name}.json", result)
        dirs = [d for r in records if (d := self.out / run_name(r["arm"], r["seed"])).is_dir()]
        if report and dirs:
            from mutualrl.study.report import write_report

            write_report(dirs, self.results_dir / f"{self.name}_report", title=f"mutualrl {self.name}",
                         notes=self.notes)
        if table:
            print_table(result)
        return result
