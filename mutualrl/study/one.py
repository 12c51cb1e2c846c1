"""One run of a study, in its own process: ``python -m mutualrl.study.one RUN_DIR [--resume]``.

:meth:`mutualrl.study.harness.Study.run` starts it after writing the run's spec beside ``RUN_DIR``
(``<run>.spec.json``: arm, seed, config). It records what it started from (revision, load, CPU kind,
the fingerprint of each policy's starting weights) in ``<run>.provenance.json``, labels the run
directory with its arm and trains it; torch uses ``OMP_NUM_THREADS`` threads. It ends itself once the
study that started it is gone (``--parent``: a study killed alone must not leave runs training, which
a restarted study would resume into the same folders beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mutualrl.config.modelref import resolve_model_path
from mutualrl.config.resolve import load_config
from mutualrl.run.orphan import exit_when_orphaned
from mutualrl.run.trainer import MutualTrainer
from mutualrl.study.provenance import cpu_kind, git_rev, weights_fingerprint
from mutualrl.study.records import provenance_path, spec_path
from mutualrl.study.report import ARM_FILE


def run_one(run_dir: Path, resume: bool = False) -> None:
    """Train the run whose spec lies beside ``run_dir`` (resuming it from its last checkpoint)."""
    spec = json.loads(spec_path(run_dir).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(spec["config"])
    weights = {p.name: weights_fingerprint(resolve_model_path(p.model)) for p in cfg.policies}
    provenance_path(run_dir).write_text(json.dumps({"git_rev": git_rev(), "started": time.time(),
                                                    "load_avg": os.getloadavg()[0], "cpu": cpu_kind(),
                                                    "weights": weights}))
    trainer = MutualTrainer(cfg, run_dir, resume=resume, progress=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ARM_FILE).write_text(json.dumps({"arm": spec["arm"]}))
    trainer.train()


def main(argv: Sequence[str] | None = None) -> None:
    """The command line of one run (started by a study, not by hand)."""
    ap = argparse.ArgumentParser(prog="python -m mutualrl.study.one", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--parent", type=int, default=None,
                    help="the study's pid: this run exits once that process is gone (default: the parent now)")
    args = ap.parse_args(argv)
    exit_when_orphaned(args.parent if args.parent is not None else os.getppid())
    run_one(args.run_dir, args.resume)


if __name__ == "__main__":
    main()
