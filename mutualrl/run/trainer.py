"""MutualTrainer: the step loop. It calls; the workers compute.

Per step: every worker rolls out on the step's shared prompts and publishes to the exchange
(SEE); then every worker queries its peers' rows, aligns them (THL), builds its batch with the
sharing strategy and updates. Held-out evaluation every ``eval_every`` steps, checkpoints every
``checkpoint_every`` steps and at the end, one JSON line per policy per step in ``metrics.jsonl``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from mutualrl.algorithms.sharing import parse_strategy
from mutualrl.allocation import Scheduler, WorkerFailed, make_scheduler
from mutualrl.allocation.run_placement import PlanConsole, RunPlacement, launch
from mutualrl.config import RunConfig
from mutualrl.config.resolve import RunPlan, resolve, run_config
from mutualrl.errors import ConfigError, UserError
from mutualrl.exchange.url import ExchangeURL
from mutualrl.export.model import FINAL_DIR, Exported, export_run
from mutualrl.paths import METRICS, POLICIES_INFO, RUN_CONFIG, SUMMARY
from mutualrl.run.async_loop import AsyncLoop
from mutualrl.run.checkpoint import (
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    latest_checkpoint,
    read_state,
)
from mutualrl.run.progress import StepProgress
from mutualrl.run.resume import check_resumable, record_resume
from mutualrl.run.tracking import Tracker, open_trackers, scalars
from mutualrl.run.worker_api import WorkerAPI, remote_name
from mutualrl.tasks.attach import attach

__all__ = ["CHECKPOINTS", "LATEST", "MutualTrainer", "latest_checkpoint"]

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _say_unreadable_gold(report: dict[str, int]) -> None:
    """One line on stderr per data source with gold answers its verifier could not read (left out)."""
    for key, n in sorted(report.items()):
        if key.endswith("/gold_unreadable") and n:
            source = key.rsplit("/", 1)[0]
            print(f"mutualrl: data: {n} gold answers of {source!r} cannot be read by its verifier; those rows are "
                  f"left out (see policies.json)", file=sys.stderr)


COMPUTE_TOTALS: tuple[str, ...] = ("train_tokens", "optimizer_steps", "flops_sampling", "flops_scoring", "flops_update")
"""Per-policy totals a run's summary reports: what a compute-matched control is matched on."""


class MutualTrainer:
    """Train K >= 1 policies together.

    Args:
        config: a :class:`~mutualrl.config.resolve.RunPlan` (from :func:`~mutualrl.config.resolve.resolve`), or what
            it resolves: a :class:`RunConfig`, a dict or a YAML path.
        run_dir: where the run writes (config, metrics, checkpoints, exchange). ``None`` keeps
            everything in memory (no checkpoints).
        train_dataset: a ``datasets.Dataset`` (or ``DatasetDict`` with a ``train`` split) as the task's
            data, TRL-style; the config's ``task.datasets`` then holds at most one entry of options
            (columns, ``answer_extractor``, ``verifier``). ``eval_dataset``: its test split.
        reward_funcs: extra reward functions ``f(prompts, completions, **columns) -> list[float]``
            (callables or import paths), added to ``task.reward_functions``.
        resume: continue the run in ``run_dir`` from its last good checkpoint.
        scheduler: a :class:`Scheduler`; default from ``config.scheduler``.
        progress: show a progress bar.
        calibrate: time this many real steps of each policy (the first a warm-up) before MWRA's first
            plan, instead of planning from the FLOP prior (``local``/``ray`` schedulers; loads every
            model once more in this process).
        verbose: print MWRA's whole table at every re-plan (default: the first plan's table, then one
            line per re-plan saying what changed).
        console: a :class:`~mutualrl.allocation.run_placement.PlanConsole` shared with earlier runs of
            this session (their plans' table is then not printed again); default: a new one, ``verbose``.
    """

    def __init__(self, config: RunPlan | RunConfig | dict | str | Path, run_dir: str | Path | None = None, *,
                 train_dataset: Any | None = None, eval_dataset: Any | None = None,
                 reward_funcs: Sequence[Callable[..., list[float]] | str] = (), resume: bool = False,
                 scheduler: Scheduler | None = None, progress: bool = True, calibrate: int = 0,
                 verbose: bool = False, console: PlanConsole | None = None) -> None:
        if train_dataset is not None or eval_dataset is not None or reward_funcs:
            config = attach(config.config if isinstance(config, RunPlan) else config, train_dataset, eval_dataset,
                            reward_funcs)
        self.run_dir = Path(run_dir) if run_dir else None
        self.resume = resume
        # resolved once; a fresh run with a directory also reads its data (data files, hub ids) now, so
        # what only shows when read fails before anything is written
        self.plan = resolve(config, read_data=self.run_dir is not None and not resume)
        self.cfg = self.plan.config
        self.progress = progress
        self.console = console or PlanConsole(verbose)
        self.scheduler = scheduler or make_scheduler(self.cfg.scheduler, self.cfg.threads)
        if calibrate:
            self.scheduler.calibrate_steps = int(calibrate)
        self.start_step = 0
        self.history: list[dict[str, Any]] = []
        self.checkpoints = CheckpointManager(self.run_dir, keep=2) if self.run_dir else None
        self._trackers: list[Tracker] = []
        self._created_run_dir = False
        self._resume_changes: dict[str, tuple[Any, Any]] = {}
        self._wall_before = 0.0
        self._t_start = time.perf_counter()
        self.placement: RunPlacement | None = None
        """The placed plan, MWRA's state and the scheduler realising it (from :meth:`train` on)."""
        self._prepare_run_dir()

    # ------------------------------------------------------------------ run directory
    def _prepare_run_dir(self) -> None:
        d = self.run_dir
        if d is None:
            if self.cfg.save_final_model:
                raise UserError("save_final_model writes RUN_DIR/final/<policy>: give the run a directory")
            return
        if self.resume:
            if not (d / RUN_CONFIG).is_file() or not (d / CHECKPOINTS).is_dir():
                raise UserError(f"cannot resume: {str(d)!r} is not a mutualrl run directory "
                                "(no config.yaml and checkpoints/)")
            # the same check for the CLI and for Python: only what cannot change trained steps may differ
            self._resume_changes = check_resumable(run_config(d), self.cfg, d)
            ck = latest_checkpoint(d)
            trained = int((read_state(ck) or {}).get("next_step", 0)) if ck is not None else 0
            if self.cfg.steps < trained:
                raise ConfigError("steps", f"{self.cfg.steps} is fewer than the {trained} steps this run has "
                                  f"trained already (checkpoint {ck}); resume with steps >= {trained}")
            return
        if d.exists() and any(d.iterdir()):
            raise UserError(f"run directory {str(d)!r} already exists and is not empty; "
                            f"resume it with --resume {d} or choose another --output")

    def _init_files(self) -> None:
        d = self.run_dir
        assert d is not None
        self._created_run_dir = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        (d / CHECKPOINTS).mkdir(exist_ok=True)
        atomic_write_text(d / RUN_CONFIG, yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

    def _undo_init_files(self) -> None:
        """A fresh run that failed to start leaves nothing behind (it had not trained)."""
        d = self.run_dir
        if d is None or self.resume or not d.exists():
            return
        if self._created_run_dir:
            shutil.rmtree(d, ignore_errors=True)
            return

        own_db = ExchangeURL.for_run("sqlite", d).side_files() if self.cfg.exchange == "sqlite" else []
        for p in [d / CHECKPOINTS, d / RUN_CONFIG, *own_db]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _log(self, rows: list[dict[str, Any]]) -> None:
        self.history.extend(rows)
        if self.run_dir is None:
            return
        with open(self.run_dir / METRICS, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            fh.flush()
            os.fsync(fh.fileno())
        for step, metrics in scalars(rows).items():
            for t in self._trackers:
                t.log(metrics, step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> Path | None:
        """Write a complete checkpoint for the state *after* ``step - 1`` (next step = ``step``).

        Every policy's weights, optimizer and RNG states (Python, NumPy, torch, its sampling
        generator) and version, plus the exchange position; see :mod:`mutualrl.run.checkpoint`.
        """
        if self.checkpoints is None:
            return None

        def write_policies(tmp: Path) -> list[str]:
            for i, pol in enumerate(self.cfg.policies):
                self.scheduler.call_one(i, WorkerAPI.save, str(tmp / pol.name))
            return [p.name for p in self.cfg.policies]

        position = self.scheduler.call_one(0, WorkerAPI.exchange_position)
        return self.checkpoints.save(step, write_policies, {"exchange_position": int(position),
                                                            "wall_s": self._wall_s()})

    def save_model(self, output_dir: str | Path | None = None, policy: str | Sequence[str] | None = None, *,
                   merge_lora: bool = False, dtype: str = "float32") -> list[Exported]:
        """Write trained policies as Hugging Face model directories ``output_dir/<policy>`` (TRL's name;
        default ``RUN_DIR/export``): every policy, or the one (or those) named, from the run's newest
        checkpoint, which after :meth:`train` holds the final weights. Each directory loads with
        ``AutoModelForCausalLM.from_pretrained`` (LoRA policies: a peft adapter, or full weights with
        ``merge_lora``) and carries a model card; existing ones are replaced. See :mod:`mutualrl.export.model`."""
        if self.run_dir is None:
            raise UserError("save_model exports the run's checkpoint: give MutualTrainer a run directory")
        names = [policy] if isinstance(policy, str) else policy
        return export_run(self.run_dir, output_dir, policies=names, merge_lora=merge_lora, dtype=dtype,
                          overwrite=True)

    def _restore(self) -> None:
        assert self.run_dir is not None and self.checkpoints is not None
        self.checkpoints.clean_partial()
        ck = self.checkpoints.latest()
        if ck is None:
            self.start_step = 0
            self.scheduler.call_one(0, WorkerAPI.exchange_discard_after, 0)
            self._truncate_metrics(0)
            return
        state = read_state(ck)
        assert state is not None
        names = [p.name for p in self.cfg.policies]
        if list(state.get("policies", names)) != names:
            raise UserError(f"checkpoint {ck} holds policies {state.get('policies')}, the config lists {names}")
        for i, pol in enumerate(self.cfg.policies):
            self.scheduler.call_one(i, WorkerAPI.load, str(ck / pol.name))
        self.scheduler.call_one(0, WorkerAPI.exchange_discard_after, int(state["exchange_position"]))
        self.start_step = int(state["next_step"])
        self._wall_before = float(state.get("wall_s") or 0.0)  # earlier segments, up to this checkpoint
        self._truncate_metrics(self.start_step)

    def _truncate_metrics(self, next_step: int) -> None:
        """Drop metric lines of steps after the checkpoint (they will be redone)."""
        assert self.run_dir is not None
        path = self.run_dir / METRICS
        if not path.is_file():
            return
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            # rows of the resumed step (its evaluation included) are redone: keep strictly earlier ones
            if row.get("step", 0) < next_step:
                keep.append(line)
        atomic_write_text(path, "".join(k + "\n" for k in keep))
        self.history = [json.loads(k) for k in keep]

    # ------------------------------------------------------------------ the loop
    def evaluate(self, step: int) -> list[dict[str, Any]]:
        """Held-out greedy accuracy of every policy (``eval_size`` problems), logged as ``eval`` rows
        at ``step`` and returned one row per policy.

        With a validation split (``task.val_size``) an evaluation reads validation (``val_acc``), and the
        last one, at the end of the run, reads the test split too (``test_acc``): the test split is
        read once per run. Without one, every evaluation reads test."""
        cfg = self.cfg
        splits = ["val"] if cfg.task.val_size else []
        if not splits or step >= cfg.steps:
            splits.append("test")
        rows = [{"step": step, "policy": p.name, "event": "eval"} for p in cfg.policies]
        for split in splits:
            for row, r in zip(rows, self.scheduler.call(WorkerAPI.evaluate, cfg.eval_size, split), strict=True):
                row.update(r)
        self._log(rows)
        return rows

    def train(self) -> dict[str, Any]:
        """Run (or resume) the training loop. Returns a summary dict."""
        cfg = self.cfg
        self._trackers = []
        t_start = self._t_start = time.perf_counter()
        if self.run_dir is not None and not self.resume:
            self._init_files()
        try:  # the one placement step: plan, place, start the workers of the placed plan
            self.placement = launch(self.scheduler, self.plan, self.run_dir, self.console)
        except BaseException:
            self._undo_init_files()
            raise
        infos = self.placement.infos
        try:
            if self.run_dir is not None and self.resume:
                self._restore()
                if self._resume_changes:  # written back: a later plain --resume, eval, compare read it
                    record_resume(self.run_dir, cfg, self._resume_changes, self.start_step)
            if self.run_dir is not None and cfg.report_to:
                self._trackers = open_trackers(cfg.report_to, self.run_dir, cfg.run_name or self.run_dir.name,
                                               cfg.to_dict(), resume=self.resume)
            if self.run_dir is not None and self.start_step == 0:
                atomic_write_text(self.run_dir / POLICIES_INFO, json.dumps(infos, indent=1))
            _say_unreadable_gold(infos[0].get("data", {}) if infos else {})
            self._loop(t_start)
        except WorkerFailed as exc:
            ck = latest_checkpoint(self.run_dir) if self.run_dir else None
            raise WorkerFailed(exc.worker, exc.detail, checkpoint=str(ck) if ck else None,
                               resume=str(self.run_dir)) from exc
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS or self.run_dir is None:
                raise
            ck = latest_checkpoint(self.run_dir)
            raise CheckpointError(f"cannot write to run directory {self.run_dir}: {exc.strerror}; last good "
                                  f"checkpoint: {ck or 'none'}. Free space, then: mutualrl train --resume "
                                  f"{self.run_dir}") from exc
        finally:
            try:
                self.scheduler.close()
            finally:  # the plan history and the trackers are closed even when stopping workers fails
                if self.placement is not None:
                    self.placement.close()
                for t in self._trackers:
                    t.close()
        summary = self.summary(self._wall_s())
        if cfg.save_final_model and self.run_dir is not None:  # RUN_DIR/final/<policy>, from the final checkpoint
            self.save_model(self.run_dir / FINAL_DIR)
        return summary

    def _loop(self, t_start: float) -> None:
        with StepProgress(self.cfg.steps, self.start_step, enabled=self.progress,
                          names=[p.name for p in self.cfg.policies]) as bar:
            if self.cfg.sync == "async":
                self._loop_async(bar)
            else:
                self._loop_sync(bar)
            if self.start_step < self.cfg.steps or not any(r.get("event") == "eval" and r["step"] == self.cfg.steps
                                                           for r in self.history):
                bar.set_eval(self.evaluate(self.cfg.steps))

    def _step_done(self, step: int, rows: list[dict[str, Any]], bar: Any) -> None:
        """Log a finished step (one row per policy) and checkpoint after it when due."""
        self._log(rows)
        bar.advance(rows)
        nxt = step + 1
        if self.run_dir is not None and (nxt % self.cfg.checkpoint_every == 0 or nxt == self.cfg.steps):
            self.save_checkpoint(nxt)

    def _observed(self, method: Any, results: list[Any]) -> list[Any]:
        """``results`` of ``method`` on every policy, folded into MWRA's calibration."""
        for i, r in enumerate(results):
            self._observe(i, remote_name(method), r)
        return results

    def _observe(self, index: int, method: str, result: Any) -> None:
        if self.placement is not None:  # None: a loop driven without train() (tests)
            self.placement.observe(index, method, result)

    def _loop_sync(self, bar: Any) -> None:
        """A barrier per phase: every policy rolls out, then (when the strategy serves its peers) every
        policy serves, then every policy updates."""
        cfg = self.cfg
        serves = parse_strategy(cfg.sharing.strategy).serves
        for step in range(self.start_step, cfg.steps):
            if step % cfg.eval_every == 0:
                bar.set_eval(self.evaluate(step))
            t0 = time.perf_counter()
            roll = self._observed(WorkerAPI.rollout, self.scheduler.call(WorkerAPI.rollout, step))
            t1 = time.perf_counter()
            served = self._observed(WorkerAPI.serve, self.scheduler.call(WorkerAPI.serve, step)) if serves \
                else [{} for _ in cfg.policies]  # the strategy's work for the peers (scores), a phase of its own
            upd = self._observed(WorkerAPI.update, self.scheduler.call(WorkerAPI.update, step))
            t2 = time.perf_counter()
            if self.placement is not None:
                self.placement.after_update(step)
            rows = [{"step": step, "policy": p.name, **r, **s, **u, "step_rollout_s": t1 - t0, "step_update_s": t2 - t1,
                     "step_s": t2 - t0} for p, r, s, u in zip(cfg.policies, roll, served, upd, strict=True)]
            self._step_done(step, rows, bar)

    def _loop_async(self, bar: Any) -> None:
        """Bounded staleness instead of per-phase barriers: :class:`~mutualrl.run.async_loop.AsyncLoop`."""
        AsyncLoop.for_run(self.cfg, self.scheduler, self.start_step, observe=self._observe,
                          step_done=lambda step, rows: self._step_done(step, rows, bar),
                          evaluate=lambda step: bar.set_eval(self.evaluate(step))).run()

    def _wall_s(self) -> float:
        """Wall seconds of the training kept so far: earlier segments up to the checkpoint this one
        resumed from (the steps redone after it are not counted twice), plus this segment."""
        return self._wall_before + time.perf_counter() - self._t_start

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The run's outcome (written to ``summary.json`` in the run directory): wall time (of a resumed
        run: its segments together, up to the checkpoint each resumed from), steps and
        per policy its initial, final and best held-out accuracy on each split evaluated
        (``val_acc_*`` with a validation split, ``test_acc_*``: with a validation split the test split
        is read once, so its initial, final and best are the same figure), and the compute it spent
        (:data:`COMPUTE_TOTALS`, summed over the steps kept)."""
        evals = [r for r in self.history if r.get("event") == "eval"]
        out: dict[str, Any] = {"wall_s": wall_s, "steps": self.cfg.steps, "policies": {}}
        for p in self.cfg.policies:
            entry: dict[str, float] = {}
            for key in ("val_acc", "test_acc"):
                ev = [r[key] for r in evals if r["policy"] == p.name and key in r]
                if ev:
                    entry.update({f"{key}_initial": ev[0], f"{key}_final": ev[-1], f"{key}_best": max(ev)})
            steps = [r for r in self.history if r.get("policy") == p.name and r.get("event") is None]
            for key in COMPUTE_TOTALS:  # the compute a control is matched on: tokens and FLOPs by phase
                if any(key in r for r in steps):
                    entry[key] = float(sum(r.get(key, 0.0) for r in steps))
            if entry:
                out["policies"][p.name] = entry
        if self.run_dir is not None:
            atomic_write_text(self.run_dir / SUMMARY, json.dumps(out, indent=1))
        return out
