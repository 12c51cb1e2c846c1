"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, Trackio.

``report_to`` (TRL's name) lists them. A mutual run is **one** tracked run whose metric names
carry the policy (``gpt2-add/reward_mean``, ``llama-sub/test_acc``): the policies of a run are
one experiment, read side by side on one dashboard (each tool groups panels by the prefix), and the
run's config is logged once. wandb follows its own environment (``WANDB_MODE=offline``,
``WANDB_PROJECT``, ``WANDB_DIR``), trackio is local-first (``TRACKIO_DIR``); both are optional
extras (``pip install mutualrl[tracking]``), never required.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
DEFAULT_PROJECT = "mutualrl"
MACHINE_KEYS: frozenset[str] = frozenset({"pid", "ahead"})
"""Metrics that describe the process or the scheduling, not the training."""


def is_measurement(key: str) -> bool:
    """Whether metric ``key`` measures the machine (seconds ``*_s``, memory ``*_mb``, the process,
    how far a policy ran ahead) rather than the training: it may differ between two runs of one seed,
    so resume and reproducibility checks leave it out."""
    return key.endswith(("_s", "_mb")) or key in MACHINE_KEYS


class Tracker(Protocol):
    """One destination for scalar metrics."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (names with the policy prefix) at ``step``."""
        ...

    def close(self) -> None:
        """Flush and finish."""
        ...


def missing_package(name: str) -> str | None:
    """The pip package ``report_to: name`` needs when it is not installed, else None."""
    if name == "tensorboard":
        return None if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX") \
            else "tensorboard"
    return PACKAGES[name] if importlib.util.find_spec(PACKAGES[name]) is None else None


class TensorBoardTracker:
    """Scalars under ``<run>/tb``."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run (``WANDB_MODE=offline`` writes it under ``<run>/wandb`` with no network)."""

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], resume: bool = False) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT), name=run_name,
                              dir=str(run_dir), config=dict(config), resume="allow" if resume else None,
                              reinit="finish_previous")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A trackio run (local-first: a database under ``TRACKIO_DIR``)."""

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], resume: bool = False) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT), name=run_name, config=dict(config),
                     resume="allow" if resume else "never", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.trackio.log(dict(metrics), step=step)

    def close(self) -> None:
        self.trackio.finish()


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


def open_trackers(names: Sequence[str], run_dir: Path, run_name: str, config: Mapping[str, Any],
                  resume: bool = False) -> list[Tracker]:
    """One tracker per name of ``report_to`` (the names were checked when the config was resolved)."""
    return [_CLASSES[n](run_dir=run_dir, run_name=run_name, config=config, resume=resume) for n in names]


def scalars(rows: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """Per step, the numeric metrics of metric rows under ``<policy>/<name>`` (evaluations too)."""
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        step = int(r["step"])
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                out.setdefault(step, {})[f"{r['policy']}/{k}"] = float(v)
    return out
