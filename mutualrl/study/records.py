"""A study's committed records: one compact JSON per run (``<arm>-seed<N>.json``) holding what the
aggregation reads (eval rows, per-step rows of the keys that matter, the config, the code revision
that trained it, the starting weights), so that every figure re-aggregates from them alone.

Beside a run's directory lie its spec (``<run>.spec.json``: arm, seed, config, revision, written
before it starts), its provenance (``<run>.provenance.json``: what its own process recorded at its
start) and its log (``<run>.log``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STEP_KEYS = ("reward_mean", "train_acc", "train_tokens", "optimizer_steps", "gen_tokens", "peer_rows", "loss",
             "step_s", "informative_group_frac", "zero_var_group_frac", "imitate_rescue", "imitate_own",
             "self_imitate_extra", "imitate_own_extra", "imitate_replayed", "sgt_rescue", "prp_peer_samples",
             "resample_rounds", "flops_sampling", "flops_scoring", "flops_update", "distill_rows",
             "distill_gate_open", "self_imitate_groups_left_out", "self_imitate_rows_left_out")
"""The per-step metrics a compact run keeps (besides step and policy)."""


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in, mappings recursively (lists and scalars replace)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        merge = isinstance(v, Mapping) and isinstance(out.get(k), Mapping)
        out[k] = deep_merge(out[k], v) if merge else copy.deepcopy(v)
    return out


def run_name(arm: str, seed: int) -> str:
    """The name of an arm's run on a seed: its directory and its record (``.json``)."""
    return f"{arm}-seed{seed}"


def spec_path(run_dir: Path) -> Path:
    """A run's spec beside its directory (``<arm>-seed<N>.spec.json``): arm, seed, config, revision."""
    return run_dir.with_name(run_dir.name + ".spec.json")


def provenance_path(run_dir: Path) -> Path:
    """What the run's own process recorded at its start (revision, load), beside its directory."""
    return run_dir.with_name(run_dir.name + ".provenance.json")


def log_path(run_dir: Path) -> Path:
    """The run's output (stdout and stderr of its process), beside its directory."""
    return run_dir.with_name(run_dir.name + ".log")


def load_records(runs_dir: Path) -> list[dict[str, Any]]:
    """Every compact run of a study (``<arm>-seed<N>.json`` in ``runs_dir``), in name order."""
    return [json.loads(p.read_text()) for p in sorted(Path(runs_dir).glob("*-seed*.json"))]


def compact_record(run_dir: Path, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The compact record of a finished run directory: the arm of its ``spec``, its provenance, its
    eval rows and its per-step rows of :data:`STEP_KEYS` (floats rounded to 5 digits)."""
    from mutualrl.study.report import load_run

    run = load_run(run_dir)
    prov = json.loads(provenance_path(run_dir).read_text()) if provenance_path(run_dir).is_file() else {}
    return {"arm": spec["arm"], "family": spec["family"], "role": spec["role"], "seed": spec["seed"],
            "overrides": spec["overrides"], "git_rev": prov.get("git_rev", spec.get("git_rev")),
            "load_avg": prov.get("load_avg"), **{k: prov[k] for k in ("cpu", "weights") if k in prov},
            "policies": run["policies"], "strategy": run["strategy"], "wall_s": run["wall_s"],
            "config": json.loads(json.dumps(spec["config"])), "evals": run["evals"],
            "steps": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                       if k in STEP_KEYS or k in ("step", "policy")} for r in run["steps"]]}


def write_record(runs_dir: Path, record: Mapping[str, Any]) -> Path:
    """Write a compact record into ``runs_dir`` under its run's name (compact JSON)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / f"{run_name(record['arm'], record['seed'])}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    tmp.replace(path)
    return path
