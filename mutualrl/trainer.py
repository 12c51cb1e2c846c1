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
import time
from pathlib import Path
from typing import Any

import yaml

from mutualrl.allocation import Scheduler, WorkerFailed, make_scheduler
from mutualrl.checkpoint import (
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    latest_checkpoint,
    read_state,
)
from mutualrl.config import RunConfig, load_config
from mutualrl.errors import UserError

__all__ = ["CHECKPOINTS", "LATEST", "MutualTrainer", "latest_checkpoint"]

_atomic_write = atomic_write_text
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class MutualTrainer:
    """Train K >= 1 policies together.

    Args:
        config: a :class:`RunConfig`, a dict or a YAML path.
        run_dir: where the run writes (config, metrics, checkpoints, exchange). ``None`` keeps
            everything in memory (no checkpoints).
        resume: continue the run in ``run_dir`` from its last good checkpoint.
        scheduler: a :class:`Scheduler`; default from ``config.scheduler``.
        progress: show a progress bar.
    """

    def __init__(self, config: RunConfig | dict | str | Path, run_dir: str | Path | None = None, *,
                 resume: bool = False, scheduler: Scheduler | None = None, progress: bool = True) -> None:
        self.cfg = config if isinstance(config, RunConfig) else load_config(config)
        self.run_dir = Path(run_dir) if run_dir else None
        self.resume = resume
        self.progress = progress
        self.scheduler = scheduler or make_scheduler(self.cfg.scheduler, self.cfg.threads)
        self.start_step = 0
        self.history: list[dict[str, Any]] = []
        self.checkpoints = CheckpointManager(self.run_dir, keep=2) if self.run_dir else None
        self._created_run_dir = False
        self._prepare_run_dir()

    # ------------------------------------------------------------------ run directory
    def _prepare_run_dir(self) -> None:
        d = self.run_dir
        if d is None:
            return
        if self.resume:
            if not (d / "config.yaml").is_file() or not (d / CHECKPOINTS).is_dir():
                raise UserError(f"cannot resume: {str(d)!r} is not a mutualrl run directory "
                                "(no config.yaml and checkpoints/)")
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
        _atomic_write(d / "config.yaml", yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

    def preflight(self) -> None:
        """Check what only shows when it is read (data files, model directories) before anything
        is written, so that bad input fails with a :class:`UserError` and leaves no run behind."""
        from mutualrl.worker import build_task

        try:
            build_task(self.cfg)
        except (ValueError, OSError) as exc:
            raise UserError(f"task: {exc}") from None
        for i, pol in enumerate(self.cfg.policies):
            ref = pol.model
            if ref.startswith(("zoo:", "real:")) or Path(ref).expanduser().is_dir():
                continue  # zoo/real refs are built or located on demand; directories were validated
            try:
                from transformers import AutoConfig

                AutoConfig.from_pretrained(ref)
            except (OSError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(f"config error at 'policies[{i}].model': {ref!r} is neither a local model "
                                f"directory nor a model id that can be loaded ({first})") from None

    def _undo_init_files(self) -> None:
        """A fresh run that failed to start leaves nothing behind (it had not trained)."""
        d = self.run_dir
        if d is None or self.resume or not d.exists():
            return
        if self._created_run_dir:
            shutil.rmtree(d, ignore_errors=True)
            return
        for name in (CHECKPOINTS, "config.yaml", "exchange.db", "exchange.db-wal", "exchange.db-shm"):
            p = d / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _log(self, rows: list[dict[str, Any]]) -> None:
        self.history.extend(rows)
        if self.run_dir is None:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            fh.flush()
            os.fsync(fh.fileno())
        if self._tb is not None:
            for r in rows:
                for k, v in r.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self._tb.add_scalar(f"{r['policy']}/{k}", v, r["step"])

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> Path | None:
        """Write a complete checkpoint for the state *after* ``step - 1`` (next step = ``step``).

        Every policy's weights, optimizer and RNG states (Python, NumPy, torch, its sampling
        generator) and version, plus the exchange position; see :mod:`mutualrl.checkpoint`.
        """
        if self.checkpoints is None:
            return None

        def write_policies(tmp: Path) -> list[str]:
            for i, pol in enumerate(self.cfg.policies):
                self.scheduler.call_one(i, "save", str(tmp / pol.name))
            return [p.name for p in self.cfg.policies]

        position = self.scheduler.call_one(0, "exchange_position")
        return self.checkpoints.save(step, write_policies, {"exchange_position": int(position)})

    def _restore(self) -> None:
        assert self.run_dir is not None and self.checkpoints is not None
        self.checkpoints.clean_partial()
        ck = self.checkpoints.latest()
        if ck is None:
            self.start_step = 0
            self.scheduler.call_one(0, "exchange_discard_after", 0)
            self._truncate_metrics(0)
            return
        state = read_state(ck)
        assert state is not None
        names = [p.name for p in self.cfg.policies]
        if list(state.get("policies", names)) != names:
            raise UserError(f"checkpoint {ck} holds policies {state.get('policies')}, the config lists {names}")
        for i, pol in enumerate(self.cfg.policies):
            self.scheduler.call_one(i, "load", str(ck / pol.name))
        self.scheduler.call_one(0, "exchange_discard_after", int(state["exchange_position"]))
        self.start_step = int(state["next_step"])
        self._truncate_metrics(self.start_step)

    def _truncate_metrics(self, next_step: int) -> None:
        """Drop metric lines of steps after the checkpoint (they will be redone)."""
        assert self.run_dir is not None
        path = self.run_dir / "metrics.jsonl"
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
        _atomic_write(path, "".join(k + "\n" for k in keep))
        self.history = [json.loads(k) for k in keep]

    # ------------------------------------------------------------------ the loop
    def evaluate(self, step: int) -> list[dict[str, Any]]:
        res = self.scheduler.call("evaluate", self.cfg.eval_size)
        rows = [{"step": step, "policy": p.name, "event": "eval", **r} for p, r in zip(self.cfg.policies, res)]
        self._log(rows)
        return rows

    def train(self) -> dict[str, Any]:
        """Run (or resume) the training loop. Returns a summary dict."""
        cfg = self.cfg
        self._tb = None
        t_start = time.perf_counter()
        if self.run_dir is not None and not self.resume:
            self.preflight()
            self._init_files()
        try:
            infos = self.scheduler.start(cfg, self.run_dir)
        except BaseException:
            self.scheduler.close()
            self._undo_init_files()
            raise
        try:
            if self.run_dir is not None and self.resume:
                self._restore()
            if self.run_dir is not None and cfg.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.run_dir / "tb"))
                except ImportError:
                    self._tb = None
            if self.run_dir is not None and self.start_step == 0:
                _atomic_write(self.run_dir / "policies.json", json.dumps(infos, indent=1))
            self._loop(t_start)
        except WorkerFailed as exc:
            ck = latest_checkpoint(self.run_dir) if self.run_dir else None
            where = f"; last good checkpoint: {ck}" if ck else "; no checkpoint was written yet"
            raise RuntimeError(f"{exc}{where}. Resume with: mutualrl train --resume {self.run_dir}") from exc
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS or self.run_dir is None:
                raise
            ck = latest_checkpoint(self.run_dir)
            raise CheckpointError(f"cannot write to run directory {self.run_dir}: {exc.strerror}; last good "
                                  f"checkpoint: {ck or 'none'}. Free space, then: mutualrl train --resume "
                                  f"{self.run_dir}") from exc
        finally:
            self.scheduler.close()
            if self._tb is not None:
                self._tb.close()
        return self.summary(time.perf_counter() - t_start)

    def _loop(self, t_start: float) -> None:
        cfg = self.cfg
        from mutualrl.progress import StepProgress

        with StepProgress(cfg.steps, self.start_step, enabled=self.progress,
                          names=[p.name for p in cfg.policies]) as bar:
            if cfg.sync == "async":  # bounded staleness instead of per-phase barriers (MWRA)
                from mutualrl.allocation.async_loop import run_async

                run_async(self, bar)
                return
            for step in range(self.start_step, cfg.steps):
                if step % cfg.eval_every == 0:
                    bar.set_eval(self.evaluate(step))
                t0 = time.perf_counter()
                roll = self.scheduler.call("rollout", step)
                t1 = time.perf_counter()
                upd = self.scheduler.call("update", step)
                t2 = time.perf_counter()
                rows = []
                for p, r, u in zip(cfg.policies, roll, upd):
                    rows.append({"step": step, "policy": p.name, **r, **u,
                                 "step_rollout_s": t1 - t0, "step_update_s": t2 - t1, "step_s": t2 - t0})
                self._log(rows)
                bar.advance(rows)
                nxt = step + 1
                if self.run_dir is not None and (nxt % cfg.checkpoint_every == 0 or nxt == cfg.steps):
                    self.save_checkpoint(nxt)
            if self.start_step < cfg.steps or not any(r.get("event") == "eval" and r["step"] == cfg.steps
                                                      for r in self.history):
                bar.set_eval(self.evaluate(cfg.steps))

    def summary(self, wall_s: float) -> dict[str, Any]:
        evals = [r for r in self.history if r.get("event") == "eval"]
        out: dict[str, Any] = {"wall_s": wall_s, "steps": self.cfg.steps, "policies": {}}
        for p in self.cfg.policies:
            ev = [r for r in evals if r["policy"] == p.name]
            if ev:
                out["policies"][p.name] = {"test_acc_initial": ev[0]["test_acc"], "test_acc_final": ev[-1]["test_acc"],
                                           "test_acc_best": max(r["test_acc"] for r in ev)}
        if self.run_dir is not None:
            _atomic_write(self.run_dir / "summary.json", json.dumps(out, indent=1))
        return out
