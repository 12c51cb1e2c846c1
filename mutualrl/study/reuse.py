"""When a study may keep a run instead of training it again: a committed record of the same config
(torch threads aside: they set the speed, not the training) trained from the same starting weights.

The records are what is committed, so a study continued on a fresh machine (its run directories
gone) reuses them; a later stage of a study takes an earlier stage's records of the same config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mutualrl.config.modelref import resolve_model_path
from mutualrl.errors import UserError
from mutualrl.study.provenance import weights_fingerprint
from mutualrl.study.records import run_name


def same_config(a: Mapping[str, Any], b: Mapping[str, Any], *, ignore_threads: bool) -> bool:
    """Whether two run configs train the same (both checked, defaults filled in; with
    ``ignore_threads`` torch's thread count aside). A config that does not check is no match."""
    from mutualrl.config.resolve import load_config

    try:
        ca, cb = (load_config(dict(c), check_paths=False) for c in (a, b))
    except (ValueError, UserError):
        return False
    if ignore_threads:
        ca, cb = dataclasses.replace(ca, threads=None), dataclasses.replace(cb, threads=None)
    return ca == cb


class RecordFinder:
    """Finds the committed record of a run in study ``name``'s records or in those of the studies
    ``reuse_from`` (for the seeds ``reuse_from_seeds``, None: any), all under ``results``; a record
    taken from another study is copied into this one's, marked ``reused_from``."""

    def __init__(self, results: Path, name: str, reuse_from: Sequence[str] = (),
                 reuse_from_seeds: Sequence[int] | None = None, say: Callable[[str], None] = print) -> None:
        self.results = Path(results)
        self.name = name
        self.reuse_from = list(reuse_from)
        self.reuse_from_seeds = None if reuse_from_seeds is None else list(reuse_from_seeds)
        self.say = say
        self._fingerprints: dict[str, str] = {}

    @property
    def runs_dir(self) -> Path:
        """This study's records."""
        return self.results / f"{self.name}_runs"

    def weights(self, cfg: Mapping[str, Any]) -> dict[str, str]:
        """The fingerprint of each policy's starting weights in ``cfg`` (cached per model path); ``{}``
        when a model cannot be resolved on this machine (nothing to compare)."""
        out = {}
        for pol in cfg["policies"]:
            try:
                path = resolve_model_path(pol["model"])
            except Exception:  # noqa: BLE001 - a model this machine cannot resolve: nothing to compare
                return {}
            if path not in self._fingerprints:
                self._fingerprints[path] = weights_fingerprint(path)
            out[pol["name"]] = self._fingerprints[path]
        return out

    def _places(self, seed: int) -> list[Path]:
        others = [] if self.reuse_from_seeds is not None and seed not in self.reuse_from_seeds else self.reuse_from
        return [self.runs_dir, *(self.results / f"{other}_runs" for other in others)]

    def recorded(self, arm: str, seed: int, cfg: Mapping[str, Any]) -> bool:
        """Whether a record of ``arm`` on ``seed`` trained on ``cfg`` (threads aside) from this
        machine's starting weights exists; one found in another study joins this study's records."""
        name = run_name(arm, seed) + ".json"
        for place in self._places(seed):
            try:
                record = json.loads((place / name).read_text())
                recorded = record["config"]
            except (OSError, ValueError, KeyError):
                continue
            if not same_config(recorded, cfg, ignore_threads=True):
                continue
            if record.get("weights") and (here := self.weights(cfg)) and record["weights"] != here:
                self.say(f"{name}: recorded on other starting weights than this machine's; trained again")
                continue
            if place != self.runs_dir:
                self.runs_dir.mkdir(parents=True, exist_ok=True)
                record["reused_from"] = place.name.removesuffix("_runs")
                (self.runs_dir / name).write_text(json.dumps(record, separators=(",", ":")))
            return True
        return False
